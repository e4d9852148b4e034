"""The collectives of tensor parallelism's exact mode, over a private copy of
the tensor-parallel group.

Every transfer goes to or from *one* rank (a layer's primary): ``gather``
and ``scatter``, never an all-gather, so a shard crosses the network once.
Shards are padded to the ``torch.chunk`` size ``⌈n/T⌉`` so every rank sends
the same number of elements.  Traffic is recorded in kaisa's
:class:`~kaisa.distributed.communicator.CommStats` as the bytes *this rank sends to another
rank* (a primary's own shard is not counted), so the sum over ranks is the
bytes on the network:

* ``tp_factor_gather`` — a call's input (rowwise) or output-gradient
  (colwise) shards, gathered onto the primary during forward/backward;
* ``tp_grad_gather`` — the gradient shards of the layers a primary
  preconditions, once per step;
* ``tp_grad_scatter`` — the preconditioned shards back to their ranks;
* ``tp_agree`` — which layers take part this step (one small all-reduce).

A private group (``new_group`` over the same ranks) keeps these collectives
apart from the DTensor collectives parallelize_module issues on the mesh's
own group; every rank runs the same forward and backward, so the order of
both is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kaisa.distributed import collectives
from kaisa.distributed.communicator import CommStats

__all__ = ["TPGroup"]


class TPGroup:
    """Gather onto / scatter from one rank of the tensor-parallel group.

    Args:
        ranks: global ranks of the tensor-parallel group, in mesh order
            (position ``t`` holds shard ``t``).
        stats: where the bytes are recorded.
        timeout_s: timeout of the private group (None: the default's).
    """

    def __init__(self, ranks: Sequence[int], stats: CommStats, timeout_s: float | None) -> None:
        self.ranks = tuple(ranks)
        self.size = len(self.ranks)
        self.rank = self.ranks.index(collectives.rank())
        self.stats = stats
        self.group = collectives.new_group(self.ranks, timeout_s)

    def gather_last_dim(self, shard: Tensor, dst: int, full: int) -> Tensor | None:
        """The shards of a tensor split on its last dimension (``torch.chunk``
        layout, ``full`` wide in all), concatenated on rank ``dst`` (a
        position in the group); None elsewhere."""
        chunk = -(-full // self.size)
        padded = shard.new_zeros(*shard.shape[:-1], chunk)
        padded[..., : shard.shape[-1]] = shard
        parts = self.gather(padded.contiguous(), dst, "tp_factor_gather")
        if parts is None:
            return None
        return torch.cat(list(parts), dim=-1)[..., :full]

    def gather(self, flat: Tensor, dst: int, kind: str) -> Tensor | None:
        """Every rank's equal-shaped ``flat`` stacked on ``dst`` (None elsewhere)."""
        if self.size == 1:
            return flat.unsqueeze(0)
        parts = [torch.empty_like(flat) for _ in range(self.size)] if self.rank == dst else None
        collectives.gather(flat, parts, self.ranks[dst], self.group)
        if self.rank != dst:
            self.stats.record(kind, flat.numel() * flat.element_size())
            return None
        assert parts is not None
        return torch.stack(parts)

    def scatter(self, pieces: list[Tensor] | None, like: Tensor, src: int) -> Tensor:
        """Piece ``t`` of ``src``'s ``pieces`` on rank ``t`` (``like`` gives the
        shape and dtype everyone receives)."""
        if self.size == 1:
            assert pieces is not None
            return pieces[0]
        out = torch.empty_like(like)
        if self.rank == src:
            assert pieces is not None
            sent = sum(p.numel() * p.element_size() for i, p in enumerate(pieces) if i != src)
            self.stats.record("tp_grad_scatter", sent)
        scattered = pieces if self.rank == src else None
        collectives.scatter(out, scattered, self.ranks[src], self.group)
        return out

    def sum(self, values: Tensor) -> Tensor:
        """``values`` summed over the group, in place (small flag vectors)."""
        if self.size > 1:
            collectives.all_reduce_sum(values, self.group)
            self.stats.record("tp_agree", values.numel() * values.element_size())
        return values
