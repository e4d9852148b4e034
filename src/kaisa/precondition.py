"""Applying Kronecker-factored operators to a gradient, and the KL clip.

A layer's gradient is a tensor whose axis ``i`` is acted on by the factor with
``spec.axis == i``; for Linear and Conv2d it is the ``[d_out, d_in(+1)]``
matrix, with G on axis 0 and A on axis 1.  With ``vec`` stacking columns,
``(A⊗G) vec(X) = vec(G X A)`` for symmetric A, so every Kronecker-factored
operator is a sequence of per-axis matrix products (:func:`mul_axis`).

The KL clip is split in two so that its inner product can be summed over the
ranks that hold other parts of the model before the square root.

Where a layer's gradient matrix ``[∇W | ∇b]`` is the concatenation of its
parameters' own gradients, its first product can read them where they lie
(:func:`mul_axis_from`) and its last product can write straight into them
(:func:`mul_axis_to`): two gradient-sized copies fewer per layer and step
than assembling the matrix and copying ``V`` back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "kl_scale",
    "kl_scale_value",
    "kl_term",
    "mul_axis",
    "mul_axis_from",
    "mul_axis_to",
    "sum_kl_terms",
]


def mul_axis(v: Tensor, m: Tensor, axis: int, out: Tensor | None = None) -> Tensor:
    """``out[..., j, ...] = Σ_i v[..., i, ...] m[i, j]`` along ``axis``.

    For a matrix: ``mᵀ v`` on axis 0 and ``v m`` on axis 1, written into
    ``out`` when given (a reused buffer, :mod:`kaisa.workspace`; it must not
    be ``v``).  Higher-order tensors ignore ``out``.
    """
    if v.dim() == 2:
        if out is None:
            return m.t() @ v if axis == 0 else v @ m
        return torch.mm(m.t(), v, out=out) if axis == 0 else torch.mm(v, m, out=out)
    return torch.movedim(torch.tensordot(v, m, dims=([axis], [0])), -1, axis)


def mul_axis_from(blocks: Sequence[Tensor], m: Tensor, axis: int, out: Tensor) -> Tensor:
    """:func:`mul_axis` of the matrix ``[b_0 | b_1 | …]`` given as its column
    blocks (a weight's and a bias's gradients as they lie), into ``out``,
    without assembling the matrix.

    On axis 0 each block's columns are their own product, written into
    ``out``'s columns (a strided view BLAS writes directly); on axis 1 the
    blocks' products with ``m``'s rows are summed.
    """
    col = 0
    for i, block in enumerate(blocks):
        width = block.shape[1]
        if axis == 0:
            torch.mm(m.t(), block, out=out[:, col : col + width])
        elif i == 0:
            torch.mm(block, m[col : col + width], out=out)
        else:
            out.addmm_(block, m[col : col + width])
        col += width
    return out


def mul_axis_to(v: Tensor, m: Tensor, axis: int, blocks: Sequence[Tensor]) -> None:
    """:func:`mul_axis` of ``v`` written into the column blocks ``blocks`` of
    the result (a layer's parameters' gradients): each block is the product
    restricted to its columns, so no result is assembled and copied.  The
    blocks must not overlap ``v`` or ``m``."""
    col = 0
    for block in blocks:
        width = block.shape[1]
        if axis == 0:
            torch.mm(m.t(), v[:, col : col + width], out=block)
        else:
            torch.mm(v, m[:, col : col + width], out=block)
        col += width


def kl_term(preconditioned: Tensor, grad: Tensor) -> Tensor:
    """One layer's ``⟨V, ∇⟩`` as a 0-d tensor in ``V``'s dtype (summed over
    layers, and model-parallel groups, before :func:`kl_scale`)."""
    return torch.vdot(preconditioned.reshape(-1), grad.reshape(-1).to(preconditioned.dtype))


def sum_kl_terms(preconditioned: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """:func:`kl_term` of a matrix held as column blocks (same blocks on both sides)."""
    terms = [kl_term(v, g) for v, g in zip(preconditioned, grads)]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def kl_scale(inner: Tensor, lr: float, kl_clip: float) -> Tensor:
    """``ν = min(1, sqrt(kl_clip / |lr²·inner|))``; a zero inner product gives ν = 1."""
    vg = inner.abs() * (lr * lr)
    return torch.clamp(torch.sqrt(kl_clip / vg), max=1.0)


def kl_scale_value(inner: float, lr: float, kl_clip: float) -> float:
    """:func:`kl_scale` of a Python number (the inner product read on CPU,
    where reading it costs nothing): the same rule, NaN kept as NaN."""
    vg = abs(inner) * (lr * lr)
    if math.isnan(vg):
        return math.nan
    return 1.0 if vg == 0.0 else min(1.0, math.sqrt(kl_clip / vg))
