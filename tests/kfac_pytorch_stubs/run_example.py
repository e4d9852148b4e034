"""Run one of kfac-pytorch's example modules under torchrun, on CPU, with stand-ins.

Usage (what tests/integration/test_kfac_pytorch_examples.py launches)::

    torchrun --standalone --nproc_per_node=N run_example.py examples.torch_cifar10_resnet ARGS...

Before the example's module runs (``runpy``, as ``__main__``) this installs:

- ``torch.utils.tensorboard``: the real module imports the ``tensorboard``
  package, which is not installed; the stand-in's ``SummaryWriter`` appends
  each scalar to ``<log_dir>/scalars.jsonl`` so the test can read the losses.
- Two CPU adaptations of calls the CIFAR-10 script makes for CUDA, which torch
  itself refuses on CPU whatever the preconditioner: ``DistributedDataParallel(
  cpu_model, device_ids=[local_rank])`` (the ids are dropped for a CPU module)
  and ``DataLoader(..., prefetch_factor=8, persistent_workers=True)`` with no
  worker processes (both options are dropped when ``num_workers`` is 0).
- ``torch.set_num_threads(4)``, which the CIFAR-10 script calls on every rank,
  is capped at the launcher's ``OMP_NUM_THREADS``: on a 2-core machine four
  threads per rank made a step 2.4× slower (measured).
  None of the three changes what is computed.

Everything else — argument parsing, data, model, K-FAC options, the
``LambdaParamScheduler``, checkpoints — is the example's own code.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import types
from typing import Any

import torch
import torch.utils.data


class SummaryWriter:
    """``torch.utils.tensorboard.SummaryWriter`` stand-in: scalars as JSON lines."""

    def __init__(self, log_dir: str | None = None, **kwargs: Any) -> None:
        self.log_dir = log_dir or "runs"
        os.makedirs(self.log_dir, exist_ok=True)
        self._path = os.path.join(self.log_dir, "scalars.jsonl")

    def add_scalar(self, tag: str, value: Any, global_step: int | None = None, **_: Any) -> None:
        record = {"tag": tag, "value": float(value), "step": global_step}
        with open(self._path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class CpuDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """DDP that ignores ``device_ids`` for a module whose parameters are all on CPU."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if all(p.device.type == "cpu" for p in module.parameters()):
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        super().__init__(module, *args, **kwargs)


class CpuDataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """DataLoader that drops worker-only options when there are no workers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("num_workers", 0) == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        super().__init__(*args, **kwargs)


def _thread_cap(set_num_threads: Any) -> Any:
    """``torch.set_num_threads`` that never exceeds ``$OMP_NUM_THREADS`` (when set)."""

    def capped(n: int) -> None:
        limit = os.environ.get("OMP_NUM_THREADS")
        set_num_threads(min(n, int(limit)) if limit else n)

    return capped


def install() -> None:
    """Put the stand-in and the three adaptations in place."""
    tensorboard = types.ModuleType("torch.utils.tensorboard")
    tensorboard.SummaryWriter = SummaryWriter  # type: ignore[attr-defined]
    sys.modules["torch.utils.tensorboard"] = tensorboard
    torch.nn.parallel.DistributedDataParallel = CpuDistributedDataParallel  # type: ignore[misc]
    torch.utils.data.DataLoader = CpuDataLoader  # type: ignore[misc]
    torch.set_num_threads = _thread_cap(torch.set_num_threads)


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: run_example.py MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
