"""How a sharded Linear's gradient matrix travels between its shards and its
primary rank (tensor parallelism, exact mode).

The layer's canonical gradient is the ``[d_out, d_in(+1)]`` matrix of the
unsharded layer.  Rank ``t`` holds, of it:

* colwise (``Shard(0)``): rows ``rows_t``, bias column included;
* rowwise (``Shard(1)``): columns ``cols_t`` of the weight; the bias column
  is replicated, so every rank holds all of it.

Every rank's piece is padded to the ``torch.chunk`` size ``c = ⌈n/T⌉`` so
that one ``gather``/``scatter`` moves equal-sized pieces.  A rowwise
layer's bias column is not gathered (the primary has it) but is scattered
with every piece, so each rank writes the same preconditioned bias.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.layers.tensor_parallel import ExactShardedAdapter, Style, local, shard_range

__all__ = ["ShardLayout"]


class ShardLayout:
    """Pieces of one exact-mode layer over a tensor-parallel group of ``size``."""

    def __init__(self, adapter: ExactShardedAdapter, size: int) -> None:
        self.adapter = adapter
        self.size = size
        self.colwise = adapter.style is Style.COLWISE
        self.bias = adapter.has_bias
        split = adapter.out_features if self.colwise else adapter.in_features
        self.chunk = -(-split // size)
        self.ranges = [shard_range(split, size, t) for t in range(size)]

    def _bias_grad(self) -> Tensor:
        bias = self.adapter.bias
        assert bias is not None and bias.grad is not None
        return local(bias.grad)

    # -- gather: local gradient shards -> the full matrix on the primary ---------------
    def grad_piece(self) -> Tensor:
        """This rank's gradient shard, padded, flat (what it sends to the primary)."""
        weight = local(self.adapter.weight.grad)
        if self.colwise:
            rows = weight
            if self.bias:
                rows = torch.cat([rows, self._bias_grad().reshape(-1, 1)], dim=1)
            out = rows.new_zeros(self.chunk, rows.shape[1])
            out[: rows.shape[0]] = rows
        else:
            out = weight.new_zeros(weight.shape[0], self.chunk)
            out[:, : weight.shape[1]] = weight
        return out.reshape(-1)

    @property
    def grad_piece_numel(self) -> int:
        a = self.adapter
        return self.chunk * (a.a_dim if self.colwise else a.out_features)

    def assemble(self, pieces: Tensor) -> Tensor:
        """The full gradient matrix from the ``[size, numel]`` gathered pieces."""
        a = self.adapter
        if self.colwise:
            blocks = pieces.reshape(self.size, self.chunk, a.a_dim)
            return torch.cat([blocks[t, : r.stop - r.start] for t, r in self.ranges_t()])
        blocks = pieces.reshape(self.size, a.out_features, self.chunk)
        weight = torch.cat([blocks[t, :, : r.stop - r.start] for t, r in self.ranges_t()], dim=1)
        if not self.bias:
            return weight
        return torch.cat([weight, self._bias_grad().reshape(-1, 1).to(weight.dtype)], dim=1)

    def ranges_t(self) -> list[tuple[int, slice]]:
        return list(enumerate(self.ranges))

    # -- scatter: the preconditioned matrix -> every rank's shard ---------------------
    @property
    def out_piece_numel(self) -> int:
        a = self.adapter
        if self.colwise:
            return self.chunk * a.a_dim
        return a.out_features * (self.chunk + int(self.bias))

    def split(self, matrix: Tensor) -> list[Tensor]:
        """Rank ``t``'s part of the preconditioned ``matrix``, padded and flat, for every t."""
        a = self.adapter
        pieces = []
        for r in self.ranges:
            if self.colwise:
                out = matrix.new_zeros(self.chunk, a.a_dim)
                out[: r.stop - r.start] = matrix[r]
            else:
                out = matrix.new_zeros(a.out_features, self.chunk + int(self.bias))
                out[:, : r.stop - r.start] = matrix[:, r]
                if self.bias:
                    out[:, -1] = matrix[:, -1]
            pieces.append(out.reshape(-1))
        return pieces

    def write(self, piece: Tensor, rank: int) -> None:
        """Copy this rank's received ``piece`` into its local gradient shards."""
        a = self.adapter
        n = self.ranges[rank].stop - self.ranges[rank].start
        weight = local(a.weight.grad)
        if self.colwise:
            block = piece.reshape(self.chunk, a.a_dim)[:n]
            weight.copy_(block[:, : a.in_features])
            if self.bias:
                self._bias_grad().copy_(block[:, -1])
            return
        block = piece.reshape(a.out_features, self.chunk + int(self.bias))
        weight.copy_(block[:, :n])
        if self.bias:
            self._bias_grad().copy_(block[:, -1])
