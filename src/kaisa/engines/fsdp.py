"""FSDP2 (``torch.distributed.fsdp.fully_shard``): row-sharded gradients.

After backward every parameter's ``.grad`` is a ``DTensor`` placed
``Shard(0)`` on a one-dimensional mesh (under HSDP ``(Replicate(),
Shard(0))``: each replica's shard group holds the same rows): rank ``r`` holds rows
``[r·c, min((r+1)·c, R))`` of the averaged gradient, ``c = ⌈R/W⌉`` (the
layout of ``torch.chunk``; late ranks may hold none).  Hooks see full local
activations and output gradients, so capture is unchanged.

A layer's full gradient is needed only by its gradient workers: the row
shards of all layers with the same workers are padded to ``c`` rows and
assembled in one collective — a ``gather`` onto the worker (MEM-OPT) or an
all-gather (every rank a worker).  After kaisa's broadcast every rank holds
the preconditioned gradient and copies back only its own rows: no
communication.  With ``set_requires_gradient_sync(False)`` on the first
micro-batches of an accumulation window ``.grad`` is None until the syncing
one, which is where ``precond.step()`` belongs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from kaisa.distributed import collectives
from kaisa.distributed.tensors import is_fsdp2_model, row_shard
from kaisa.engines.base import Engine, GradientMarks, ShardedReads, assemble_by_workers
from kaisa.engines.pytorch import unwrap_model
from kaisa.layers.base import LayerAdapter

__all__ = ["FSDP2Engine", "is_fsdp2_model"]


class FSDP2Engine(Engine, ShardedReads):
    """Gradients of a model sharded with ``fully_shard``."""

    name = "fsdp2"

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_model(model)  # fully_shard changes the class in place, not the names

    def present(self, adapter: LayerAdapter) -> bool:
        return adapter.weight.grad is not None

    def gradient_marks(self, adapters: Sequence[LayerAdapter]) -> list[Any]:
        marks = []
        for adapter in adapters:
            grad = adapter.weight.grad
            marks.append(None if grad is None else GradientMarks.of(row_shard(grad)[0]))
        return marks

    def read(self, adapter: LayerAdapter) -> Tensor | None:
        if not self.present(adapter):
            return None
        everyone = tuple(range(collectives.world_size()))
        return self.read_many([adapter], [everyone])[0]

    def read_many(
        self, adapters: Sequence[LayerAdapter], workers: Sequence[Sequence[int]]
    ) -> list[Tensor | None]:
        fulls = assemble_by_workers(adapters, workers, _assemble)
        return [None if f is None else a.matrix_of(f) for a, f in zip(adapters, fulls)]

    def gradient_dtype(self, adapter: LayerAdapter) -> torch.dtype:
        return adapter.weight.dtype

    def write(self, adapter: LayerAdapter, matrix: Tensor) -> None:
        weight, bias = adapter.matrix_to_grads(matrix)
        values = [weight] if bias is None else [weight, bias]
        for param, rows, value in zip(adapter.parameters(), adapter.param_rows(), values):
            local, group = row_shard(param.grad)
            first = (rows.start or 0) if rows is not None else 0
            _write_rows(local, group, int(param.shape[0]), value, first)


def _chunk(total_rows: int, world: int) -> int:
    return -(-total_rows // world)


def _assemble(params: list[nn.Parameter], ranks: tuple[int, ...]) -> list[Tensor] | None:
    """Full gradients of ``params`` on ``ranks`` (None elsewhere): one collective."""
    shards = [row_shard(p.grad) for p in params]
    group = shards[0][1]
    # the workers this shard group serves: the same set on all its members
    # (under HSDP a worker gathers from the replica it belongs to)
    members = set(collectives.group_ranks(group))
    ranks = tuple(r for r in ranks if r in members)
    if not ranks:
        return None
    world = collectives.world_size(group)
    padded = []
    for p, (local, _) in zip(params, shards):
        rows = _chunk(int(p.shape[0]), world)
        block = local.new_zeros((rows, *p.shape[1:]))
        block[: local.shape[0]] = local
        padded.append(block.reshape(-1))
    everyone = collectives.gather_onto(torch.cat(padded), ranks, group)
    if everyone is None:
        return None
    out, at = [], 0
    for p, block in zip(params, padded):
        rows = _chunk(int(p.shape[0]), world)
        part = everyone[:, at : at + block.numel()].reshape(world * rows, *p.shape[1:])
        out.append(part[: p.shape[0]])
        at += block.numel()
    return out


def _write_rows(local: Tensor, group: Any, total_rows: int, value: Tensor, first: int) -> None:
    """Copy rows ``[first, first + len(value))`` of the full gradient that fall
    in this rank's shard into it."""
    rank = collectives.rank(group)
    start = rank * _chunk(total_rows, collectives.world_size(group))
    lo, hi = max(first, start), min(first + value.shape[0], start + local.shape[0])
    if hi > lo:
        local[lo - start : hi - start].copy_(value[lo - first : hi - first])
