"""Kronecker factors: their typed specs, batch statistics and running averages.

A layer's curvature block is ``F_0 ⊗ F_1 ⊗ …`` over the axes of its gradient
tensor; each factor is described by a :class:`FactorSpec` (dense ``d×d`` or
diagonal ``d``, the gradient axis it acts on, and whether it is estimated
from the layer's inputs or from its output gradients).  Everything that sizes,
sends, stores or plans a factor reads it from the spec.

Conventions (stated in docs/numerics.md and tested against dense references):

* an input factor is ``A = Σ_r ā_r ā_rᵀ / R`` over all R rows (data points ×
  shared positions × calls) a layer saw between two factor updates — on every
  rank: sums and counts are reduced separately, so the result is the
  statistics of all rows, whatever their split over ranks;
* an output-gradient factor is ``G = Σ ĝ ĝᵀ / N`` with ``ĝ = m·g`` and N the
  data points of the passes that reached the layer; ``m`` undoes the loss
  averaging: ``m = n·k`` for a loss averaged over the call's n data points,
  ``m = n·S·k`` for one averaged over data points and S positions, ``m = 1``
  for a summed loss; ``k`` is what each micro-batch's loss was divided by
  (``accumulation_steps``; 1 under a pipelining schedule, which divides the
  gradients after backward instead) and a grad scaler's scale is divided
  out too.

With these, the factors depend neither on the batch size, nor on the number
of micro-batches, nor on the world size or the split of rows over ranks.

Everything here is pure tensor math on the canonical ``[batch, shared,
features]`` shape; nothing knows about modules, hooks or processes.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from kaisa.blocks import BlockLayout
from kaisa.config import AssignmentStrategy, LargeFactor, LossAverage

__all__ = [
    "FactorKind",
    "FactorSource",
    "FactorSpec",
    "all_finite",
    "contribution",
    "contribution_features_first",
    "factor_finite",
    "grad_multiplier",
    "gram",
    "kfac_factors",
    "limit_factors",
    "running_average_",
]


class FactorKind(str, enum.Enum):
    """How a factor is stored: a full symmetric matrix, its diagonal, or its
    diagonal blocks (a flat vector, :mod:`kaisa.blocks`)."""

    DENSE = "dense"
    DIAGONAL = "diagonal"
    BLOCK_DIAGONAL = "block_diagonal"


class FactorSource(str, enum.Enum):
    """What a factor is estimated from."""

    INPUT = "input"  #: the layer's input rows (with a ones column for a bias)
    OUTPUT_GRAD = "output_grad"  #: the gradient w.r.t. the layer's output


@dataclass(frozen=True)
class FactorSpec:
    """One Kronecker factor of a layer's curvature block.

    Attributes:
        name: the factor's name in reports and checkpoints (``"A"``, ``"G"``).
        kind: dense or diagonal.
        dim: its size d (a ``d×d`` matrix or a ``d`` vector).
        axis: the axis of the layer's gradient tensor it acts on.
        source: inputs or output gradients.
        blocks: the number of diagonal blocks of a block-diagonal factor (1 otherwise).
    """

    name: str
    kind: FactorKind
    dim: int
    axis: int
    source: FactorSource
    blocks: int = 1

    def __post_init__(self) -> None:
        if (self.blocks > 1) != (self.kind is FactorKind.BLOCK_DIAGONAL):
            raise ValueError(
                f"factor {self.name}: blocks must be > 1 exactly for a block-diagonal factor; "
                f"got kind={self.kind.value}, blocks={self.blocks}"
            )

    @property
    def layout(self) -> BlockLayout:
        """How the ``dim`` rows split into diagonal blocks (one block unless block-diagonal)."""
        return BlockLayout(self.dim, self.blocks)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.kind is FactorKind.DENSE:
            return (self.dim, self.dim)
        return (self.numel,)

    @property
    def numel(self) -> int:
        if self.kind is FactorKind.BLOCK_DIAGONAL:
            return self.layout.numel
        return self.dim * self.dim if self.kind is FactorKind.DENSE else self.dim

    @property
    def symmetric(self) -> bool:
        """Whether it may travel as a triangle (``symmetry_aware``; a
        block-diagonal factor travels whole)."""
        return self.kind is FactorKind.DENSE

    @property
    def label(self) -> str:
        """Its size in plans and reports: ``4096``, ``32000 diagonal`` or
        ``32000 block-diagonal 8×4000``."""
        if self.kind is FactorKind.DIAGONAL:
            return f"{self.dim} diagonal"
        if self.kind is FactorKind.BLOCK_DIAGONAL:
            return f"{self.dim} block-diagonal {self.layout.describe()}"
        return str(self.dim)

    def cost(self, strategy: AssignmentStrategy) -> float:
        """What its decomposition costs the planner: n³ (compute) or n² (memory),
        summed over the blocks of a block-diagonal factor; n if diagonal."""
        if self.kind is FactorKind.DIAGONAL:
            return float(self.dim)
        return self.layout.cost(3 if strategy is AssignmentStrategy.COMPUTE else 2)


def kfac_factors(a_dim: int, g_dim: int) -> tuple[FactorSpec, ...]:
    """The two dense factors of a Linear/Conv2d-like layer: A from the inputs,
    acting on the gradient matrix's columns, and G from the output gradients,
    acting on its rows."""
    return (
        FactorSpec("A", FactorKind.DENSE, a_dim, axis=1, source=FactorSource.INPUT),
        FactorSpec("G", FactorKind.DENSE, g_dim, axis=0, source=FactorSource.OUTPUT_GRAD),
    )


def limit_factors(
    specs: tuple[FactorSpec, ...], max_dim: int | None, mode: LargeFactor
) -> tuple[FactorSpec, ...]:
    """``specs`` with every dense factor above ``max_dim`` (``max_factor_dim``)
    made diagonal or block-diagonal (``large_factor``, :mod:`kaisa.blocks`)."""
    if max_dim is None:
        return specs
    out = []
    for spec in specs:
        if spec.kind is FactorKind.DENSE and spec.dim > max_dim:
            if mode is LargeFactor.DIAGONAL:
                spec = dataclasses.replace(spec, kind=FactorKind.DIAGONAL)
            else:
                blocks = BlockLayout.at_most(spec.dim, max_dim).blocks
                spec = dataclasses.replace(spec, kind=FactorKind.BLOCK_DIAGONAL, blocks=blocks)
        out.append(spec)
    return tuple(out)


def grad_multiplier(
    loss_average: LossAverage,
    batch: int,
    positions: int,
    loss_divisor: int,
    items: float | None = None,
) -> float:
    """The factor ``m`` with ``ĝ = m·g`` that undoes the loss averaging
    (``loss_divisor``: what each micro-batch's loss was divided by)."""
    if loss_average is LossAverage.ITEMS:
        if items is None or not items > 0:
            raise RuntimeError(
                "kaisa: loss_average='items' but precond.loss_items is not set to the positive "
                f"number the loss is divided by (got {items!r}); set it before backward"
            )
        return float(items)
    if loss_average is LossAverage.BATCH:
        return float(batch * loss_divisor)
    if loss_average is LossAverage.BATCH_AND_SEQUENCE:
        return float(batch * positions * loss_divisor)
    return 1.0


def _foldable(
    kind: FactorKind, scale: float | Tensor, compute: torch.dtype, dtype: torch.dtype
) -> float | None:
    """The scale as the product's ``alpha``, where it can ride there: a
    dense (or block-diagonal) factor formed in the dtype it is kept in,
    scaled by a number (a loss scale read on device is applied afterwards)."""
    if kind is not FactorKind.DIAGONAL and not isinstance(scale, Tensor) and compute == dtype:
        return float(scale)
    return None


def contribution(
    rows: Tensor,
    kind: FactorKind,
    dtype: torch.dtype,
    scale: float | Tensor = 1.0,
    compute_dtype: torch.dtype | None = None,
    blocks: int = 1,
) -> Tensor:
    """``scale · Σ_r x_r x_rᵀ`` (or its diagonal, or its ``blocks`` diagonal
    blocks, flat: :mod:`kaisa.blocks`) of ``[batch, shared, features]`` rows.

    K-FAC-expand: every (data point, shared position) pair is a row.  The sum
    is formed with autocast off, whatever precision the forward or backward
    pass ran in: in ``compute_dtype`` when given (``factor_compute_dtype``,
    e.g. bfloat16 for a faster product) and returned in ``dtype``, in which it
    is accumulated.  A diagonal factor has no product to speed up and is
    always formed in ``dtype``.
    """
    compute = dtype if compute_dtype is None or kind is FactorKind.DIAGONAL else compute_dtype
    flat = rows.reshape(-1, rows.shape[-1]).to(compute)
    alpha = _foldable(kind, scale, compute, dtype)
    folded = alpha is not None
    with torch.autocast(flat.device.type, enabled=False):
        if kind is FactorKind.DENSE:
            # the scale rides in the product (alpha) where it can: no pass over the result
            out = gram(flat, 1.0 if alpha is None else alpha)
        elif kind is FactorKind.BLOCK_DIAGONAL:
            out = BlockLayout(flat.shape[1], blocks).gram(flat, 1.0 if alpha is None else alpha)
        else:
            out = (flat * flat).sum(0)
    out = out.to(dtype)
    if not folded and (isinstance(scale, Tensor) or scale != 1.0):
        out.mul_(scale)
    return out


#: From this width on, a CPU Gram is formed by blocks (:func:`gram`).
BLOCKED_GRAM_MIN_WIDTH = 256
#: Blocks per side of the grid a blocked Gram is split into.
GRAM_BLOCKS = 3


def gram(flat: Tensor, alpha: float = 1.0) -> Tensor:
    """``alpha · flatᵀ flat`` of ``[rows, d]`` rows.

    A Gram matrix is symmetric, yet one matrix product computes both of its
    triangles.  BLAS's ``syrk`` computes one, but torch exposes none, so on
    CPU, for ``d ≥ 256`` and at least ``2d`` rows, the Gram is split into a
    3 × 3 grid of column blocks: the 6 blocks on and above the diagonal are
    products, the 3 below are their transposes (measured here, one thread:
    1.2–1.4× faster than one product for a convolution's patch chunks of
    1,800–8,000 rows of 257–577 columns; no faster with fewer rows than
    ``2d``, as an MLP's 128-row batches; docs/benchmarks.md).  Other Grams,
    and every Gram off the CPU, are one product.  The sums are the same, to
    rounding.
    """
    rows, d = (int(n) for n in flat.shape)
    if flat.device.type != "cpu" or d < BLOCKED_GRAM_MIN_WIDTH or rows < 2 * d:
        if alpha == 1.0:
            return flat.t() @ flat
        return torch.addmm(flat.new_zeros(()), flat.t(), flat, beta=0, alpha=alpha)
    edges = [d * i // GRAM_BLOCKS for i in range(GRAM_BLOCKS + 1)]
    spans = list(itertools.pairwise(edges))
    out = flat.new_empty(d, d)
    for i, (a, b) in enumerate(spans):
        left = flat[:, a:b].t()
        for c, e in spans[i:]:
            block = out[a:b, c:e]
            product = left @ flat[:, c:e]
            if alpha == 1.0:
                block.copy_(product)
            else:
                torch.mul(product, alpha, out=block)
            if c != a:
                out[c:e, a:b].copy_(block.t())
    return out


def all_finite(t: Tensor) -> Tensor:
    """0-d bool: no NaN/Inf in ``t``, from one reduction (NaN and Inf propagate
    through a sum; a finite sum that overflows is treated as non-finite too).
    Several times cheaper than ``isfinite(t).all()``."""
    return torch.isfinite(t.sum())


def factor_finite(t: Tensor) -> Tensor:
    """:func:`all_finite` of a factor, read from its diagonal where it is a
    dense ``d×d`` one: every factor is a positive combination of Grams
    ``Σ x xᵀ``, whose diagonal ``Σ x_i²`` is non-finite wherever any entry
    ``x_i`` is, and whose other entries are bounded by ``sqrt(F_ii F_jj)``,
    so a finite diagonal means a finite factor (to rounding at the edge of
    the float range).  ``d`` reads instead of ``d²``: on an MLP's factors the
    full check was a third of the running average's passes."""
    if t.dim() == 2 and t.shape[0] == t.shape[1]:
        return all_finite(torch.diagonal(t))
    return all_finite(t)


def running_average_(running: Tensor, batch: Tensor, decay: float) -> Tensor:
    """In place: ``running ← decay·running + (1−decay)·batch``; returns "rejected".

    A non-finite ``batch`` leaves ``running`` unchanged.  On an accelerator
    the choice is made on device — the interpolation weight becomes 0 — so
    there is no host synchronisation and no temporary the size of the
    factor; ``batch`` is consumed (its non-finite entries are zeroed).  On
    CPU reading the verdict costs nothing, so a finite batch (every one, in
    practice) skips the repair pass and the weight's arithmetic: two passes
    instead of three (1.5x faster on a 785 x 785 factor).
    """
    if batch.device.type == "cpu":
        finite = bool(factor_finite(batch))
        if finite:
            running.lerp_(batch, 1.0 - decay)
        return torch.tensor(not finite)
    rejected = ~factor_finite(batch)
    weight = (~rejected).to(running.dtype) * (1.0 - decay)
    batch.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    running.lerp_(batch, weight)
    return rejected


def contribution_features_first(
    cols: Tensor,
    kind: FactorKind,
    dtype: torch.dtype,
    scale: float | Tensor = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """:func:`contribution` of the rows ``cols.transpose(1, 2)``, given
    ``[batch, features, shared]`` columns — the layout a convolution's output
    gradient ``[N, C, H·W]`` already has.

    Transposing those to rows and flattening them would copy the whole
    tensor; instead ``Σ_n X_n X_nᵀ`` is accumulated over the data points with
    one batched product (``addbmm``: ``X_nᵀ`` is a strided view, no copy, and
    no ``[N, C, C]`` intermediate).  The same sum of the same products, to
    rounding; ``compute_dtype`` as in :func:`contribution`.
    """
    compute = dtype if compute_dtype is None or kind is FactorKind.DIAGONAL else compute_dtype
    flat = cols.to(compute)
    alpha = _foldable(kind, scale, compute, dtype)
    folded = alpha is not None
    with torch.autocast(flat.device.type, enabled=False):
        if kind is FactorKind.DENSE:
            out = flat.new_zeros(flat.shape[1], flat.shape[1])
            out.addbmm_(flat, flat.mT, alpha=1.0 if alpha is None else alpha)
        else:
            out = (flat * flat).sum((0, 2))
    out = out.to(dtype)
    if not folded and (isinstance(scale, Tensor) or scale != 1.0):
        out.mul_(scale)
    return out
