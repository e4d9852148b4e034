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

Three things keep compiled runs right and off the clock:

* **hooks guarded**: by default dynamo does not guard on module hooks, so a
  model of the same class — another arm's, with or without kaisa's hooks —
  would run the first one's compiled code (measured: a plain run then trains
  on K-FAC's graphs). Compiled runs turn those guards on
  (``skip_nnmodule_hook_guards = False``): each run's model compiles code of
  its own;
* **compiled on its own instance, before its clock starts**: the lockstep
  loop takes a few steps of each compiled run — a factor step and a
  non-factor step, the two variants kaisa's capture compiles — then puts
  every state back as it was (:func:`kaisa_lab.cli.train.warm_compiled`); a
  model's hooks are part of its guards, so a throwaway model's compilation
  would not serve it;
* **one graph for every batch size and room for every variant**: the batch
  dimension is marked dynamic (an epoch's last batch may be short), and
  dynamo's limit on recompilations of one function (8), which a lockstep
  group of many compiled runs passes, is raised to :data:`RECOMPILE_LIMIT`.

A run whose K-FAC reads a fraction of the positions compiles like any
other: each factor step's draw is a graph input (:mod:`kaisa.core.positions`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kaisa_lab.cli.spec import RunSpec

__all__ = ["BACKENDS", "RECOMPILE_LIMIT", "compile_run"]

#: ``torch.compile`` backends a run may name: inductor (what users run),
#: aot_eager (autograd traced, no code generated: the same numbers as eager,
#: for tests) and eager (dynamo alone)
BACKENDS = ("inductor", "aot_eager", "eager")
#: compiled variants of one function a process keeps (two per compiled run)
RECOMPILE_LIMIT = 64


def compile_run(spec: RunSpec, net: nn.Module, preconditioner: Any, device: torch.device) -> Any:
    """``net`` compiled under ``spec.compile_model`` (hooks guarded; on CUDA
    the preconditioner's non-factor steps recorded as CUDA graphs)."""
    if spec.compile_model not in BACKENDS:
        raise ValueError(f"compile_model={spec.compile_model!r}: one of {', '.join(BACKENDS)}")
    config = torch._dynamo.config
    config.skip_nnmodule_hook_guards = False
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    if preconditioner is not None and device.type == "cuda":
        preconditioner.compile(mode="reduce-overhead")
    return torch.compile(net, backend=spec.compile_model)
