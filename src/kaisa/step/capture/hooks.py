"""The hook objects capture registers, and what they ask of autograd.

A hook is a small picklable object (:class:`ModuleHook`): a deep copy or pickle of
the model carries an inert hook instead, so a copied model (an EMA or a
teacher) never captures into this preconditioner.  The predicates read
autograd's state on the calling thread: which backward is running
(:func:`_graph_task`), whether a forward is activation checkpointing's
discarded recomputation, and whether a backward accumulates into the
parameters kaisa preconditions (:func:`_updates_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from kaisa.core.specs import FactorSpec
from kaisa.layers.state import KFACLayer
from kaisa.warn import warn_user

__all__ = ["ModuleHook", "TermMemo", "first_tensor", "input_term_key"]


def first_tensor(inputs: Any) -> Tensor | None:
    if isinstance(inputs, Tensor):
        return inputs
    if isinstance(inputs, (tuple, list)) and inputs and isinstance(inputs[0], Tensor):
        return inputs[0]
    return None


def _graph_task() -> int:
    """The id of the backward pass running on this thread, -1 outside backward."""
    return int(torch._C._current_graph_task_id())


def _discarded_recomputation() -> bool:
    """Whether this forward is non-reentrant activation checkpointing's
    recomputation, whose outputs only refill saved tensors: their gradients
    never arrive (the original forward's hooks receive them), so capturing
    here would be wasted work.  Read from the saved-tensor hooks that
    ``torch.utils.checkpoint`` installs (private API; False if it changes)."""
    try:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except Exception:  # pragma: no cover - a torch without this API
        return False
    if not hooks:
        return False
    return str(getattr(hooks[0], "__qualname__", "")).startswith("_recomputation_hook")


def _in_backward() -> bool:
    """Whether autograd is running a backward pass on this thread (recomputation)."""
    return _graph_task() != -1


def _updates_gradients(params: list[nn.Parameter]) -> bool:
    """Whether the running backward accumulates into the ``.grad`` of any of
    ``params`` — the gradients kaisa preconditions.  A backward that leaves
    them alone (``torch.autograd.grad`` of an input gradient for a gradient
    penalty, ``backward(inputs=[x])``) delivers output gradients of another
    quantity, which must not enter G.  Asked of autograd's engine for plain
    leaf parameters; ``torch.autograd.grad`` taken with respect to a
    parameter (a loop that sets ``.grad`` itself) is its gradient and counts.
    A sharded weight (not a plain leaf) counts, as a
    ``backward()`` would.  A backward whose status the engine cannot give is
    not counted, with a warning once (:func:`_unreadable`)."""
    asked = False
    for p in params:
        if not p.requires_grad:
            continue
        if not p.is_leaf or hasattr(p, "placements"):
            return True
        try:
            node = torch.autograd.graph.get_gradient_edge(p).node
            if torch._C._will_engine_execute_node(node):
                return True
        except RuntimeError as exc:
            if "autograd.grad()" in str(exc):
                return True  # autograd.grad with respect to p: p's own gradient
            return _unreadable(exc)
        except Exception as exc:  # a torch without the private API
            return _unreadable(exc)
        asked = True
    return not asked


_WARNED_UNREADABLE: list[bool] = []


def _unreadable(exc: BaseException) -> bool:
    """False (the backward is not counted), after one warning per process:
    counting a backward kaisa cannot place could let a gradient penalty's
    output gradients into G; leaving it out costs only this step's factors."""
    if not _WARNED_UNREADABLE:
        _WARNED_UNREADABLE.append(True)
        warn_user(
            "kaisa: autograd could not say whether this backward fills the "
            f"parameters' .grad ({type(exc).__name__}: {exc}); its output gradients "
            "are not counted in the factors. Report this with your torch version",
            RuntimeWarning,
        )
    return False


class _InertHook:
    """What a copied or unpickled model gets in place of a kaisa hook."""

    def __call__(self, *args: Any) -> None:
        return None


def _inert() -> _InertHook:
    return _InertHook()


class ModuleHook:
    """A bound hook that fires only for the module it was registered on and
    turns inert when the model is deep-copied or pickled."""

    def __init__(self, fn: Callable[..., None], module: nn.Module) -> None:
        self.fn = fn
        self.module = module

    def __call__(self, module: nn.Module, *args: Any) -> Any:
        if module is self.module:
            return self.fn(module, *args)  # a forward hook may replace the output
        return None

    def __reduce__(self) -> tuple[Callable[[], _InertHook], tuple[()]]:
        return (_inert, ())


#: terms of one input shared by several layers (see :func:`input_term_key`)
TermMemo = dict[tuple[Any, ...], tuple[Tensor, float]]


def input_term_key(layer: KFACLayer, spec: FactorSpec) -> tuple[Any, ...]:
    """What makes two layers' input terms of one call the same tensor: the
    q, k and v rows of a self-attention's packed projection read one input,
    so their common input factor is formed once, not three times."""
    adapter = layer.adapter
    return (
        type(adapter),
        spec.name,
        spec.kind,
        spec.dim,
        spec.blocks,
        adapter.has_bias,
        adapter.reduce,
        adapter.factor_compute_dtype,
        layer.factor_dtype,
    )
