"""Block-diagonal factors: their layout, their math, and when a factor becomes one.

A dense ``d×d`` factor costs ``d²`` entries for itself, its batch sums, its
eigenbasis or inverse and the decomposition's workspace, and ``d³`` to
decompose: an untied language-model head over a 32,000-token vocabulary has a
4.1 GB ``G``.  Above ``max_factor_dim`` (:class:`kaisa.KFACConfig`) a dense
factor is therefore kept either

* **diagonal** (``large_factor='diagonal'``, the default): ``d`` entries,
  as kfac-jax lets a layer keep a diagonal factor, and as kaisa keeps a tied
  head's vocabulary-sized ``G``; or
* **block-diagonal** (``large_factor='block'``): ``k = ⌈d / max_factor_dim⌉``
  diagonal blocks of sizes as equal as possible (``d // k`` or ``d // k + 1``,
  the larger ones first), as Distributed Shampoo blocks a dimension above
  ``max_preconditioner_dim``.  Everything off the blocks is zero; each block
  is decomposed on its own (``Σ b³`` instead of ``d³``) and the Kronecker
  math stays exact for the block-diagonal factor, because the damped inverse
  of ``A ⊗ diag(G_1, …, G_k)`` is ``diag`` of the blocks' damped inverses.
  It holds ``Σ b² ≈ d · max_factor_dim`` entries: less than dense, but
  growing with ``d``, which is why it is not the default.

A block-diagonal factor (and its eigenbasis or inverse) is stored as one flat
vector, the blocks one after the other, each row-major: a single tensor, like
any other factor, for reductions, broadcasts and checkpoints.  With at most two
block sizes it is viewed as at most two batches ``[count, b, b]``
(:meth:`BlockLayout.groups`), so every operation is one batched call per size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

__all__ = ["BlockGroup", "BlockLayout"]


@dataclass(frozen=True)
class BlockGroup:
    """``count`` consecutive blocks of size ``size``: rows ``start…`` of the
    factor's axis, entries ``offset…`` of the flat storage."""

    start: int
    count: int
    size: int
    offset: int

    @property
    def rows(self) -> int:
        return self.count * self.size

    @property
    def numel(self) -> int:
        return self.count * self.size * self.size


@dataclass(frozen=True)
class BlockLayout:
    """``dim`` split into ``blocks`` diagonal blocks of sizes as equal as possible."""

    dim: int
    blocks: int

    def __post_init__(self) -> None:
        if not 1 <= self.blocks <= self.dim:
            raise ValueError(f"blocks must be in [1, {self.dim}]; got {self.blocks}")

    @classmethod
    def at_most(cls, dim: int, max_block: int) -> BlockLayout:
        """The fewest blocks of at most ``max_block`` rows each."""
        return cls(dim, math.ceil(dim / max_block))

    @cached_property
    def groups(self) -> tuple[BlockGroup, ...]:
        """One group per block size (at most two), larger blocks first."""
        small, larger = divmod(self.dim, self.blocks)
        out, start, offset = [], 0, 0
        for count, size in ((larger, small + 1), (self.blocks - larger, small)):
            if count:
                out.append(BlockGroup(start, count, size, offset))
                start += count * size
                offset += count * size * size
        return tuple(out)

    @property
    def numel(self) -> int:
        """Entries of the flat storage: ``Σ b²``."""
        return sum(g.numel for g in self.groups)

    @property
    def largest(self) -> int:
        return self.groups[0].size

    def sizes(self) -> list[int]:
        return [g.size for g in self.groups for _ in range(g.count)]

    def describe(self) -> str:
        """``8×4000`` or ``5×3867+8×3866`` (blocks × rows)."""
        return "+".join(f"{g.count}×{g.size}" for g in self.groups)

    def cost(self, power: int) -> float:
        """``Σ b^power`` over the blocks (the planner's n³ or n² per block)."""
        return float(sum(g.count * g.size**power for g in self.groups))

    # -- views and construction ---------------------------------------------------
    def views(self, flat: Tensor) -> Iterator[tuple[BlockGroup, Tensor]]:
        """Each group with its ``[count, b, b]`` view of ``flat`` (or of a
        batch of such vectors, ``[..., numel]``: views ``[..., count, b, b]``)."""
        lead = flat.shape[:-1]
        for g in self.groups:
            yield g, flat[..., g.offset : g.offset + g.numel].view(*lead, g.count, g.size, g.size)

    def dense(self, flat: Tensor) -> Tensor:
        """The ``d×d`` matrix: the blocks on the diagonal, zeros elsewhere (tests, reports)."""
        return torch.block_diag(*(b for _, v in self.views(flat) for b in v.unbind(0)))

    def from_dense(self, matrix: Tensor) -> Tensor:
        """The flat storage of ``matrix``'s diagonal blocks (the rest is dropped)."""
        parts = []
        for g in self.groups:
            for i in range(g.count):
                at = g.start + i * g.size
                parts.append(matrix[at : at + g.size, at : at + g.size].reshape(-1))
        return torch.cat(parts)

    def eye(self, dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
        """The flat identity (every block ``I``)."""
        out = torch.zeros(self.numel, dtype=dtype, device=device)
        for _, v in self.views(out):
            v.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        return out

    def diagonal(self, flat: Tensor) -> Tensor:
        """The ``d`` diagonal entries, in the axis's order."""
        return torch.cat([v.diagonal(dim1=-2, dim2=-1).reshape(-1) for _, v in self.views(flat)])

    def gram(self, rows: Tensor, alpha: float = 1.0) -> Tensor:
        """``alpha · rowsᵀ rows`` of ``[R, d]`` rows, its diagonal blocks only:
        one batched product per group, ``Σ R b²`` multiply-adds instead of
        ``R d²``, and never a ``d×d`` temporary."""
        out = rows.new_empty(self.numel)
        for g, view in self.views(out):
            x = rows[:, g.start : g.start + g.rows].reshape(rows.shape[0], g.count, g.size)
            x = x.permute(1, 0, 2)  # [count, R, b]
            torch.bmm(x.transpose(1, 2), x, out=view)
            if alpha != 1.0:
                view.mul_(alpha)
        return out

    def mul(self, v: Tensor, flat: Tensor, axis: int, transpose: bool = False) -> Tensor:
        """:func:`kaisa.core.kronecker.mul_axis` with the block-diagonal matrix
        ``M`` stored in ``flat``: ``out[…, j, …] = Σ_i v[…, i, …] M[i, j]``
        along ``axis`` (``Mᵀ`` with ``transpose``), block by block."""
        moved = v.movedim(axis, -1)
        out = torch.empty_like(moved)
        for g, view in self.views(flat):
            m = view.transpose(1, 2) if transpose else view
            part = moved[..., g.start : g.start + g.rows]
            lead = part.shape[:-1]
            x = part.reshape(-1, g.count, g.size).transpose(0, 1)  # [count, rest, b]
            y = torch.bmm(x, m)  # [count, rest, b]
            out[..., g.start : g.start + g.rows] = y.transpose(0, 1).reshape(*lead, g.rows)
        return out.movedim(-1, axis)
