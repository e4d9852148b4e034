"""A run's model under ``torch.compile``, kaisa attached first.

Why a run would be compiled: on an accelerator an eager K-FAC factor step is
bound by kernel launches — each registered layer's hooks form its statistics
in kernels of their own. Compiled after kaisa is attached, the model's
forward and backward form every layer's statistics inside their graphs
(:mod:`kaisa.step.capture.graph`), so a factor step launches what the graphs
launch and ``step()`` folds the statistics in a few multi-tensor kernels; on
CUDA the preconditioner's non-factor application is recorded once and
replayed as a CUDA graph too (``precond.compile(mode="reduce-overhead")``).
Every arm of a comparison is compiled alike, first-order ones included.

Two things keep compiled runs of one process apart and off the clock:

* **one class per graph**: dynamo does not guard on module hooks, so a model
  of the same class would run the first one's compiled code, with or without
  kaisa's hooks. Each run's model becomes an instance of a subclass named by
  what shapes its graph (:func:`signature`: K-FAC or not, its options, the
  layers it covers, the Fisher, the positions read); runs that share a
  signature share the compiled code, which is what lets the untimed warm-up
  (:func:`kaisa_lab.cli.train.warm_up`, one throwaway model per signature)
  compile it before any clock starts;
* **room for every variant**: each signature compiles a factor step and a
  non-factor step; dynamo's limit on recompilations of one function (8)
  would send a many-armed group's later runs back to eager, so it is raised
  to :data:`RECOMPILE_LIMIT`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from kaisa_lab.cli.spec import RunSpec

__all__ = ["BACKENDS", "RECOMPILE_LIMIT", "compile_run", "signature"]

#: ``torch.compile`` backends a run may name: inductor (what users run),
#: aot_eager (autograd traced, no code generated: the same numbers as eager,
#: for tests) and eager (dynamo alone)
BACKENDS = ("inductor", "aot_eager", "eager")
#: compiled variants of one function a process keeps (two per signature)
RECOMPILE_LIMIT = 64

_CLASSES: dict[tuple[type[nn.Module], str], type[nn.Module]] = {}


def signature(spec: RunSpec) -> str:
    """A digest of what shapes a run's compiled graphs: equal for runs that
    differ only in the seed, the schedule or the optimizer's numbers."""
    shape: dict[str, Any] = {
        "kfac": spec.kfac,
        "kfac_kwargs": {k: repr(v) for k, v in sorted(spec.kfac_kwargs.items())},
        "kfac_layers": spec.kfac_layers,
        "fisher": spec.fisher,
        "position_fraction": spec.position_fraction,
        "backend": spec.compile_model,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]


def compile_run(
    spec: RunSpec, model: nn.Module, net: nn.Module, preconditioner: Any, device: torch.device
) -> nn.Module:
    """``net`` (``model``, wrapped or not) compiled under ``spec.compile_model``,
    ``model`` made an instance of its signature's class; on CUDA the
    preconditioner's non-factor steps recorded as CUDA graphs."""
    if spec.compile_model not in BACKENDS:
        raise ValueError(f"compile_model={spec.compile_model!r}: one of {', '.join(BACKENDS)}")
    cls, sig = type(model), signature(spec)
    if (cls, sig) not in _CLASSES:
        _CLASSES[cls, sig] = type(f"{cls.__name__}_{sig}", (cls,), {"__module__": cls.__module__})
    model.__class__ = _CLASSES[cls, sig]
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    if preconditioner is not None and device.type == "cuda":
        preconditioner.compile(mode="reduce-overhead")
    return torch.compile(net, backend=spec.compile_model)  # type: ignore[return-value]
