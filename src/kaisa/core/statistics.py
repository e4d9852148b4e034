"""Factor statistics: batch terms, Gram kernels and running averages.

What a factor is comes from its spec (:mod:`kaisa.core.specs`); this module
forms its values.

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

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kaisa.core.blocks import BlockLayout
from kaisa.core.options import LossAverage
from kaisa.core.specs import FactorKind

__all__ = [
    "all_finite",
    "contribution",
    "contribution_features_first",
    "factor_finite",
    "fold_averages_",
    "grad_multiplier",
    "gram",
]


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
    blocks, flat: :mod:`kaisa.core.blocks`) of ``[batch, shared, features]`` rows.

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
    ``2d``, as an MLP's 128-row batches; ``kaisa bench run gram``).  Other Grams,
    every Gram off the CPU and every Gram inside a compiled graph are one
    product.  The sums are the same, to
    rounding.
    """
    rows, d = (int(n) for n in flat.shape)
    plain = flat.device.type != "cpu" or d < BLOCKED_GRAM_MIN_WIDTH or rows < 2 * d
    # a compiled graph (kaisa.step.capture.graph) gets one product: the
    # compiler plans it, and writes into blocks of ``out`` would break the graph
    if plain or torch.compiler.is_compiling():
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


def fold_averages_(
    runnings: Sequence[Tensor | None],
    batches: Sequence[Tensor],
    counts: Sequence[float],
    decay: float,
    grams: Sequence[bool] | None = None,
) -> list[bool]:
    """In place, for every pair at once: ``batch ← batch / count``, then
    ``running ← decay·running + (1−decay)·batch`` where the batch is finite;
    returns each batch's verdict (a ``None`` running is left for the caller
    to start from its finite batch; a non-finite batch leaves its running
    average unchanged).

    Batched because a factor step folds every factor of the model: one at a
    time that was ten small kernels per factor on an accelerator (division,
    check, weight, repair, interpolation, count) — 1,500 launches for a
    12-block Transformer's 148 factors.  Here each device and dtype takes a
    multi-tensor division, one multi-tensor max-magnitude check (NaN and Inf
    propagate through it; on CPU over dense factors' diagonals, see
    :func:`factor_finite`), one host read of the verdicts — the factor step
    reads the step's validity anyway — and one multi-tensor interpolation of
    the finite ones.

    ``grams[i]``: whether batch ``i`` is a Gram (a factor), whose diagonal
    vouches for the rest (default: every batch is).  A method's own statistic
    (EKFAC's scales: squared projections, not a Gram) is checked whole: an
    entry of it can overflow where its diagonal does not."""
    verdicts = [True] * len(batches)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, batch in enumerate(batches):
        groups.setdefault((batch.device, batch.dtype), []).append(i)
    for (device, _), members in groups.items():
        group = [batches[i] for i in members]
        torch._foreach_div_(group, [float(counts[i]) for i in members])
        # on CPU d reads instead of d² (no launches to save); elsewhere the
        # contiguous tensors take the multi-tensor kernel's fast path
        if device.type == "cpu":
            checked = [
                _diagonal_or_all(batches[i]) if grams is None or grams[i] else batches[i]
                for i in members
            ]
        else:
            checked = group
        largest = torch.stack(torch._foreach_norm(checked, math.inf))
        for i, ok in zip(members, torch.isfinite(largest).tolist(), strict=True):
            verdicts[i] = ok
        pairs = [(runnings[i], batches[i]) for i in members if verdicts[i]]
        kept = [(r, b) for r, b in pairs if r is not None]
        if kept:
            torch._foreach_lerp_([r for r, _ in kept], [b for _, b in kept], 1.0 - decay)
    return verdicts


def _features_first_gram(flat: Tensor, alpha: float, per_point: bool | None = None) -> Tensor:
    """``alpha · Σ_n X_n X_nᵀ`` of ``[N, C, L]`` columns: one product per data
    point without a copy (``per_point``, CPU's default) or one product of
    the copied ``[N·L, C]`` rows (elsewhere)."""
    if per_point is None:
        per_point = flat.device.type == "cpu"
    if per_point:
        out = flat.new_zeros(flat.shape[1], flat.shape[1])
        return out.addbmm_(flat, flat.mT, alpha=alpha)
    rows = flat.transpose(1, 2).reshape(-1, flat.shape[1])
    return gram(rows, alpha)


def _diagonal_or_all(t: Tensor) -> Tensor:
    return torch.diagonal(t) if t.dim() == 2 and t.shape[0] == t.shape[1] else t


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

    On CPU, transposing those to rows and flattening them would copy the
    whole tensor; instead ``Σ_n X_n X_nᵀ`` is accumulated over the data
    points with one batched product (``addbmm``: ``X_nᵀ`` is a strided view,
    no copy, and no ``[N, C, C]`` intermediate).  Elsewhere the rows are
    copied and multiplied once: CUDA runs ``addbmm`` as one product per data
    point (measured on an H100: 128 launches of two kernels per layer and
    factor step at batch 128, the CNN's factor steps 1.8× slower).  The same
    sum of the same products, to rounding; ``compute_dtype`` as in
    :func:`contribution`.
    """
    compute = dtype if compute_dtype is None or kind is FactorKind.DIAGONAL else compute_dtype
    flat = cols.to(compute)
    alpha = _foldable(kind, scale, compute, dtype)
    folded = alpha is not None
    with torch.autocast(flat.device.type, enabled=False):
        if kind is FactorKind.DENSE:
            out = _features_first_gram(flat, 1.0 if alpha is None else alpha)
        else:
            out = (flat * flat).sum((0, 2))
    out = out.to(dtype)
    if not folded and (isinstance(scale, Tensor) or scale != 1.0):
        out.mul_(scale)
    return out
