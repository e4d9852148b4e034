"""Everything the CLI does differently when launched by ``torchrun`` with ``WORLD_SIZE > 1``.

Kept in one module so the training loop reads the same with one process or
many: it asks this module for a device, a wrapped model, its shard of the
training data and of the evaluation data, and for sums over ranks; with a
single process each of these is the identity.

Conventions: ``--batch-size`` is per rank; every rank draws the same number of
batches per epoch (``drop_last=True``), which DDP's collective backward needs;
only rank 0 prints and writes files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

__all__ = [
    "DeviceError",
    "DistContext",
    "eval_indices",
    "init",
    "resolve_device",
    "shutdown",
    "train_sampler",
]

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("gloo", "nccl")


class DeviceError(ValueError):
    """The requested device does not exist here (a usage error, not a crash)."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job; the default is a single process."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    #: Timeout of process groups (also those the K-FAC preconditioner creates).
    timeout_s: float | None = None
    #: Whether this module created the process group (and so must destroy it).
    owns_group: bool = False

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main rank prints and writes files."""
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model to run forward/backward through: DDP-wrapped when distributed."""
        if not self.is_distributed:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)

    def sync_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics).

        DDP broadcasts buffers at the start of each forward, so after the last
        training step each rank holds statistics updated by its own batch;
        evaluating shards with different statistics would mix models.
        """
        if self.is_distributed:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over ranks (returned on the CPU)."""
        if not self.is_distributed:
            return values
        # NCCL only reduces tensors on the GPU; gloo is happy either way.
        buffer = values.to(self.device)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        return buffer.cpu()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` picks CUDA when available; under torchrun each rank takes GPU ``LOCAL_RANK``."""
    if name not in DEVICES:
        raise DeviceError(f"device must be one of {', '.join(DEVICES)}; got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("CUDA was requested but is not available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init(device: str, backend: str | None = None, timeout_s: float = 300.0) -> DistContext:
    """Join the process group described by torchrun's environment, if any.

    The timeout turns a rank that hangs in a collective (e.g. after a peer
    crashed) into an error instead of a job that never ends.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    torch_device = resolve_device(device, local_rank)
    if world_size <= 1:
        return DistContext(device=torch_device, timeout_s=timeout_s)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            backend=backend or ("nccl" if torch_device.type == "cuda" else "gloo"),
            timeout=timedelta(seconds=timeout_s),
        )
    return DistContext(
        device=torch_device,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        timeout_s=timeout_s,
        owns_group=owns_group,
    )


def shutdown(ctx: DistContext) -> None:
    """Destroy the process group if :func:`init` created it."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def train_sampler(dataset: Dataset[Any], ctx: DistContext, seed: int) -> DistributedSampler[Any]:
    """This rank's shuffled shard of the training set; call ``set_epoch`` each epoch.

    Used with one process too (``num_replicas=1``), so the data order depends
    only on the seed and epoch, never on whether the run is distributed.
    """
    return DistributedSampler(
        dataset,
        num_replicas=ctx.world_size,
        rank=ctx.rank,
        shuffle=True,
        seed=seed,
        drop_last=True,
    )


def eval_indices(n: int, ctx: DistContext) -> torch.Tensor:
    """Disjoint strided shards of the evaluation set; together they cover it exactly once."""
    return torch.arange(ctx.rank, n, ctx.world_size)
