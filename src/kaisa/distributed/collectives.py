"""The process-group queries and one-shot collectives the engines run.

The :class:`~kaisa.distributed.communicator.Communicator` runs the step's
bucketed, asynchronous K-FAC traffic over the data-parallel group.  Engines
need something else: where a layer's gradient is partitioned (FSDP2's row
shards, DeepSpeed's ZeRO partitions, tensor parallelism's shards) they
assemble it onto the layer's gradient workers with one synchronous
collective over the group the framework partitioned it over, and ask which
rank they are in that group.  Those calls live here, so that no module
outside :mod:`kaisa.distributed` touches ``torch.distributed``
(``tests/unit/test_architecture.py`` checks it).

Ranks are global unless a function says otherwise.  ``group=None`` is the
default (world) group, as in ``torch.distributed``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_reduce_sum",
    "gather",
    "gather_onto",
    "group_ranks",
    "new_group",
    "rank",
    "scatter",
    "solo_group",
    "sum_onto",
    "world_group",
    "world_size",
]


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (None: its global rank)."""
    return dist.get_rank(group)


def world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (None: the world)."""
    return dist.get_world_size(group)


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (None: the world), in group order; (0,) alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return (0,)
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def world_group() -> Any:
    """The default group, as a group object (``dist.group.WORLD``)."""
    return dist.group.WORLD


def new_group(ranks: Sequence[int], timeout_s: float | None = None) -> Any:
    """A group over ``ranks``, created by those ranks only (local
    synchronisation), so several disjoint groups may be created side by side;
    ``timeout_s`` None: torch's default."""
    kwargs: dict[str, Any] = {"use_local_synchronization": True}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    return dist.new_group(list(ranks), **kwargs)


def solo_group() -> Any:
    """A group of this rank alone (a data-parallel group of one)."""
    return new_group([dist.get_rank()])


def gather_onto(local: Tensor, ranks: Sequence[int], group: Any) -> Tensor | None:
    """Every rank's equal-sized ``local`` stacked as ``[world, numel]`` on the
    global ``ranks`` (None elsewhere): one ``gather`` when a single rank needs
    it (MEM-OPT), an all-gather otherwise.  Every rank of ``group`` calls it."""
    world, me = dist.get_world_size(group), dist.get_rank()
    if len(ranks) == 1:
        dst = ranks[0]
        gathered = [torch.empty_like(local) for _ in range(world)] if me == dst else None
        dist.gather(local, gathered, dst=dst, group=group)
        return torch.stack(gathered) if gathered is not None else None
    # all_gather into rows of one buffer: every torch >= 2.4 backend has it
    # (all_gather_single/_into_tensor are newer or backend-dependent)
    everyone = local.new_empty(world, local.numel())
    dist.all_gather(list(everyone.unbind(0)), local.reshape(-1), group=group)
    return everyone if me in ranks else None


def sum_onto(flat: Tensor, ranks: Sequence[int], group: Any) -> bool:
    """``flat`` summed over ``group``, in place, on the global ``ranks``: one
    ``reduce`` when a single rank needs it, an all-reduce otherwise.  Returns
    whether this rank holds the sum."""
    if len(ranks) > 1:
        dist.all_reduce(flat, group=group)
        return dist.get_rank() in ranks
    dist.reduce(flat, dst=ranks[0], group=group)
    return dist.get_rank() == ranks[0]


def gather(flat: Tensor, parts: list[Tensor] | None, dst: int, group: Any) -> None:
    """``torch.distributed.gather`` of ``flat`` into ``parts`` on global rank ``dst``."""
    dist.gather(flat, parts, dst=dst, group=group)


def scatter(out: Tensor, pieces: list[Tensor] | None, src: int, group: Any) -> None:
    """``torch.distributed.scatter``: piece ``t`` of global rank ``src``'s
    ``pieces`` into ``out`` on the group's rank ``t``."""
    dist.scatter(out, pieces, src=src, group=group)


def all_reduce_sum(values: Tensor, group: Any) -> Tensor:
    """``values`` summed over ``group``, in place."""
    dist.all_reduce(values, group=group)
    return values
