"""Convolution patches as strided views, and their Gram without a row matrix.

A convolution's A factor is the Gram ``Σ_r p_r p_rᵀ`` of its patches: one row
per (data point, output position), each row the receptive field in the
weight's ``(c, k_1, …, k_d)`` order, plus a ones column for a bias.  The
straightforward construction — ``F.unfold`` (a copy), a transpose to rows
(a second copy when reshaped) and a ``cat`` with the ones column (a third) —
moves more memory than the Gram itself costs.  Here instead:

* the input is padded once into **channels-last** layout ``[N, *S, C]``
  (any ``padding_mode``; reflect, replicate and circular need the padded
  values, zeros just a wider copy), so every patch is a *strided view*
  ``[N, *O, *K, C]`` of it (``Tensor.unfold`` per spatial dimension, a step
  for the stride and a slice for the dilation) whose innermost run ``K_d·C``
  is contiguous when the dilation is 1;
* that view is copied, a few data points at a time, into one reused buffer
  whose last column already holds the ones of the bias — the buffer stays in
  cache, so building the rows costs little beyond reading the input;
* the Gram of each chunk is accumulated in the patch order ``(k, c)``, and
  only then its rows and columns are permuted to the weight's order
  ``(c, k)``: a permutation of the small ``d×d`` matrix instead of the large
  rows.

Exactness: the patch rows hold the same numbers as the unfolded ones, only
with their columns permuted by ``π``; ``P_π`` is a permutation matrix, so
``Σ (P_π p)(P_π p)ᵀ = P_π (Σ p pᵀ) P_πᵀ`` holds exactly, entry by entry — the
sums of products are the same up to the order in which the matrix product
adds them (chunking adds partial Grams), i.e. to floating-point rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from kaisa.core.specs import FactorKind
from kaisa.core.statistics import contribution

__all__ = [
    "channels_last_padded",
    "patch_gram",
    "patch_mean",
    "patch_view",
    "weight_order",
]

#: bytes of patch rows per chunk on a CPU: small enough to stay in cache
CPU_CHUNK_BYTES = 4 << 20


def channels_last_padded(x: Tensor, pad: Sequence[int], mode: str) -> Tensor:
    """``x`` ``[N, C, *S]`` padded as the convolution pads it (``pad`` in
    ``F.pad`` order, last dimension first; ``mode`` the module's
    ``padding_mode``), returned contiguous as ``[N, *S_padded, C]``."""
    if not any(pad):
        return x.movedim(1, -1).contiguous()
    if mode == "zeros":  # one copy: pad the channels-last view directly
        return F.pad(x.movedim(1, -1), (0, 0, *pad)).contiguous()
    return F.pad(x, tuple(pad), mode=mode).movedim(1, -1).contiguous()


def patch_view(
    xcl: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]
) -> Tensor:
    """The patches of channels-last ``xcl`` ``[N, *S, C]`` as a view
    ``[N, *O, *K, C]`` (no copy): ``O`` the output positions, ``K`` the
    kernel offsets, each step ``stride`` and each offset ``dilation`` apart."""
    dims = len(kernel)
    view = xcl
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        view = view.unfold(1 + i, d * (k - 1) + 1, s)  # appends the window
        if d > 1:
            view = view[..., ::d]
    return view.movedim(1 + dims, -1)  # [N, *O, C, *K] -> [N, *O, *K, C]


def weight_order(channels: int, offsets: int, bias: bool, device: torch.device) -> Tensor:
    """Index ``π`` with ``weight_layout[w] = patch_layout[π[w]]``: the weight's
    ``(c, k)`` order from the patch order ``(k, c)``; the bias column stays last."""
    order = torch.arange(offsets * channels, device=device).view(offsets, channels).t()
    order = order.reshape(-1)
    if bias:
        order = torch.cat([order, order.new_full((1,), offsets * channels)])
    return order


def patch_gram(
    view: Tensor,
    dims: int,
    bias: bool,
    dtype: torch.dtype,
    scale: float | Tensor = 1.0,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """``scale · Σ p pᵀ`` over all patch rows of ``view`` ``[N, *O, *K, C]``
    (``dims`` spatial dimensions), with a ones column for ``bias``, in the
    weight's ``(c, k…, bias)`` order — see the module docstring for why this
    equals the Gram of the unfolded rows."""
    n, out_shape = int(view.shape[0]), view.shape[1 : 1 + dims]
    kernel_shape, channels = view.shape[1 + dims : -1], int(view.shape[-1])
    positions, offsets = math.prod(out_shape), math.prod(kernel_shape)
    features = offsets * channels
    width = features + int(bias)
    step = _chunk(n, positions, width, view)
    buffer = view.new_empty(step * positions, width)
    if bias:
        buffer[:, features] = 1
    total: Tensor | None = None
    for start in range(0, n, step):
        count = min(step, n - start)
        rows = buffer[: count * positions]
        rows[:, :features].view(count, *out_shape, *kernel_shape, channels).copy_(
            view[start : start + count]
        )
        term = contribution(rows.unsqueeze(0), FactorKind.DENSE, dtype, scale, compute_dtype)
        total = term if total is None else total.add_(term)
    if total is None:  # an empty batch
        total = torch.zeros(width, width, dtype=dtype, device=view.device)
    if channels == 1 or offsets == 1:
        return total  # (k, c) and (c, k) coincide
    order = weight_order(channels, offsets, bias, total.device)
    return total.index_select(0, order).index_select(1, order)


def _chunk(n: int, positions: int, width: int, view: Tensor) -> int:
    """Data points per chunk: the whole batch off the CPU, else as many as fit
    in :data:`CPU_CHUNK_BYTES` (at least one)."""
    if view.device.type != "cpu" or n == 0:
        return max(n, 1)
    per_point = positions * width * view.element_size()
    return max(1, min(n, CPU_CHUNK_BYTES // max(1, per_point)))


def patch_mean(view: Tensor, dims: int) -> Tensor:
    """Each data point's patches averaged over the output positions, in the
    weight's order: ``[N, C·K]`` (K-FAC-reduce's input rows, before the bias
    column).  Reduced straight from the strided view, no rows are built."""
    mean = view.mean(dim=tuple(range(1, 1 + dims)))  # [N, *K, C]
    return mean.movedim(-1, 1).reshape(view.shape[0], -1)
