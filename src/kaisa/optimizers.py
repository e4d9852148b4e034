"""The user's ``optimizer=``: one optimizer, or the several that step the model.

kaisa reads two things from the optimizers that step the model: the learning
rate its KL clip assumes (the first optimizer's first param group, read at
every step), and which gradients to take away after a step skipped for
non-finite gradients (:mod:`kaisa.step.skip`), so that the loop's
``optimizer.step()`` calls change nothing. A model is often stepped by more
than one: ``torch.optim.Muon`` takes only the hidden weight matrices, and an
AdamW steps the embeddings, the head, the norms and the biases. Given only
Muon, a skipped step would leave AdamW its non-finite gradients, and its
update would write NaN into every parameter it holds; hence a list
(``optimizer=[muon, adamw]``), and a warning where the optimizers given hold
none of some trainable parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["as_optimizers", "unstepped", "warn_unstepped"]


def as_optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """``optimizer=`` as a tuple (empty: none given); a ``TypeError`` naming
    the parameter and what it accepts for anything else."""
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    if isinstance(optimizer, Sequence) and not isinstance(optimizer, str):
        found = tuple(optimizer)
        wrong = [type(o).__name__ for o in found if not isinstance(o, torch.optim.Optimizer)]
        if found and not wrong and len({id(o) for o in found}) == len(found):
            return found
        why = (
            "it is empty"
            if not found
            else f"it holds {', '.join(wrong)}"
            if wrong
            else "it names an optimizer twice"
        )
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer, a list of the optimizers that step the "
            f"model (e.g. [muon, adamw]), or None; got a {type(optimizer).__name__} ({why})"
        )
    raise TypeError(
        "optimizer must be a torch.optim.Optimizer, a list of the optimizers that step the "
        f"model (e.g. [muon, adamw]), or None; got {type(optimizer).__name__}"
    )


def _storage(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s data lives (a view of a parameter, as some optimizer
    wrappers hold, shares it); None where it cannot be read (a tensor subclass
    without storage)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


def unstepped(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[str]:
    """The names of ``model``'s trainable parameters that none of
    ``optimizers`` holds (itself or a view of its data); none where a
    parameter's data cannot be told apart."""
    held = {id(p) for o in optimizers for group in o.param_groups for p in group["params"]}
    storages = {_storage(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    names = []
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in held:
            continue
        storage = _storage(param)
        if storage is None:
            return []
        if storage not in storages:
            names.append(name)
    return names


def warn_unstepped(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """The warning where ``optimizers`` (given) leave some trainable
    parameters of ``model`` out, or None."""
    if not optimizers:
        return None
    names = unstepped(model, optimizers)
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"kaisa: the optimizer given as optimizer= holds none of {shown}; if another optimizer "
        "steps them (Muon's AdamW for the embeddings, head, norms and biases), pass them all, "
        "optimizer=[muon, adamw]: after a step skipped for non-finite gradients kaisa takes "
        "away the gradients of the optimizers it was given only, and the others would write "
        "NaN into their parameters"
    )
