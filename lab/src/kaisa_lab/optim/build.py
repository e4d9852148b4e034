"""The optimizers ``kaisa train``/``compare`` can run, and how each is built.

Two groups:

- **torch's own**: ``sgd`` (with momentum), ``adam``, ``adamw``, and ``muon``
  (``torch.optim.Muon`` on the hidden weight matrices, AdamW on the rest:
  :mod:`kaisa_lab.optim.muon`);
- **the optional extra** ``kaisa-lab[baselines]``: ``soap`` (``heavyball.SOAP``),
  ``shampoo`` (``heavyball.KLShampoo``: heavyball 3 ships Shampoo only in its
  KL-corrected form, Lin et al. 2025, arXiv:2509.03378) and ``lamb``
  (``pytorch_optimizer.Lamb``). A missing package is an
  :class:`OptionalDependencyError` naming the extra.

Every optimizer runs with its library's defaults except the learning rate
and weight decay, which come from the task (per optimizer, see
:class:`kaisa_lab.tasks.base.Defaults`). heavyball compiles its kernels with
``torch.compile`` by default, and so they run here: a baseline is measured
as its users run it. The compilation happens in the untimed warm-up steps
(:func:`kaisa_lab.cli.train.warm_up`), so it is off the clock like every
arm's one-off costs. ``compile_baseline=False`` (``--no-compile-baselines``)
switches it off with heavyball's documented switch
(``heavyball.utils.compile_mode = None``), for quick runs and tests; the math
is the same.

**Where K-FAC applies** (:data:`KFAC_BASES`). K-FAC rewrites the gradient
into the natural-gradient direction before the base optimizer's step, so it
composes with an optimizer that consumes a gradient without estimating
curvature of its own: SGD, Adam, AdamW, LAMB (the KAISA paper trained BERT
with LAMB + K-FAC) and Muon (which orthogonalises the momentum of whatever
direction it is given). SOAP and Shampoo
build their own Kronecker-factored preconditioner from the gradients they
receive; feeding them K-FAC's already-preconditioned gradient would stack
two curvature estimates of the same layer, neither of which then means what
it was built to mean, so ``compare`` gives them no K-FAC arm and
``kaisa train --kfac`` refuses them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from kaisa_lab.optim.muon import MuonWithAdamW

__all__ = [
    "BASELINE_LR",
    "COMPILE_FAILS",
    "EXTRA",
    "KFAC_BASES",
    "OPTIMIZERS",
    "OptionalDependencyError",
    "build_optimizer",
    "check_available",
]

#: Every optimizer name ``--optimizer``/``--optimizers`` accepts.
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw", "muon", "soap", "shampoo", "lamb")

#: The optimizers K-FAC runs on top of (module docstring: why not SOAP/Shampoo).
KFAC_BASES: frozenset[str] = frozenset({"sgd", "adam", "adamw", "muon", "lamb"})

#: The extra of kaisa-lab that installs the packages of the external baselines.
EXTRA = "baselines"

#: Which package each external optimizer needs (import name, distribution name).
_PACKAGES: dict[str, tuple[str, str]] = {
    "soap": ("heavyball", "heavyball"),
    "shampoo": ("heavyball", "heavyball"),
    "lamb": ("pytorch_optimizer", "pytorch-optimizer"),
}

#: The learning rate a task uses for a baseline it has not tuned: each
#: library's documented value (torch's Muon example 0.02, heavyball's SOAP and
#: KLShampoo default 3e-3, pytorch-optimizer's Lamb default 1e-3).
BASELINE_LR: Mapping[str, float] = {"muon": 0.02, "soap": 3e-3, "shampoo": 3e-3, "lamb": 1e-3}


class OptionalDependencyError(ImportError):
    """An optimizer's package is not installed; the message names the extra."""


def _import(name: str) -> ModuleType:
    module, distribution = _PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise OptionalDependencyError(
            f"optimizer {name!r} needs the package {distribution!r}, which is not installed: "
            f"pip install 'kaisa-lab[{EXTRA}]' torch==<your torch> (make venv installs it)"
        ) from err


def check_available(name: str) -> None:
    """Raise ``ValueError`` for an unknown name, :class:`OptionalDependencyError`
    when its package is missing; return quietly otherwise."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    if name in _PACKAGES:
        _import(name)


#: heavyball's own compile mode, read when it is first imported (before any switch)
_HEAVYBALL_COMPILE: dict[str, Any] = {}

#: heavyball optimizers whose compiled step fails here, so they run eager even when
#: compilation is asked for: KLShampoo's first compiled step raises an
#: ``InductorError`` (an assertion inside inductor) on torch 2.13's CPU build
COMPILE_FAILS: frozenset[str] = frozenset({"shampoo"})


def _heavyball(
    name: str, params: Any, lr: float, weight_decay: float, compile_baseline: bool
) -> torch.optim.Optimizer:
    heavyball = _import(name)
    default = _HEAVYBALL_COMPILE.setdefault("mode", heavyball.utils.compile_mode)
    mode = default if compile_baseline and name not in COMPILE_FAILS else None
    # heavyball warns once that an lr changed between steps is "experimental
    # ... only supported with multi_tensor=True"; multi_tensor is its default.
    warnings.filterwarnings("ignore", message=".*Learning rate changed between steps.*")
    cls = heavyball.SOAP if name == "soap" else heavyball.KLShampoo
    optimizer: torch.optim.Optimizer = cls(params, lr=lr, weight_decay=weight_decay)
    # heavyball reads one global switch at every call; each optimizer sets its
    # own before its step, so compiled and eager ones can share a process
    inner = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        heavyball.utils.compile_mode = mode
        return inner(*args, **kwargs)

    optimizer.step = step  # type: ignore[method-assign]
    optimizer.compiled = mode is not None  # type: ignore[attr-defined]
    return optimizer


def build_optimizer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    momentum: float = 0.9,
    adamw_lr: float | None = None,
    adamw_weight_decay: float | None = None,
    compile_baseline: bool = True,
    muon_ns_steps: int = 5,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``model``'s parameters.

    ``momentum`` is SGD's (the others keep their library's). ``adamw_lr`` and
    ``adamw_weight_decay`` are those of the AdamW that ``muon`` runs on the
    embeddings, head, norms and biases (required for ``muon``, unused otherwise).
    ``compile_baseline``: heavyball's optimizers (``soap``, ``shampoo``) with its
    default ``torch.compile`` (True) or eager.  ``muon_ns_steps``: Muon's
    Newton–Schulz iterations per step.
    """
    check_available(name)
    params = model.parameters()
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "muon":
        if adamw_lr is None or adamw_weight_decay is None:
            raise ValueError("muon needs adamw_lr and adamw_weight_decay for its AdamW part")
        return MuonWithAdamW(
            model,
            lr=lr,
            weight_decay=weight_decay,
            adamw_lr=adamw_lr,
            adamw_weight_decay=adamw_weight_decay,
            ns_steps=muon_ns_steps,
        )
    if name in ("soap", "shampoo"):
        return _heavyball(name, params, lr, weight_decay, compile_baseline)
    lamb: torch.optim.Optimizer = _import("lamb").Lamb(params, lr=lr, weight_decay=weight_decay)
    return lamb
