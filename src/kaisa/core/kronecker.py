"""Applying Kronecker-factored operators to a gradient.

A layer's gradient is a tensor whose axis ``i`` is acted on by the factor with
``spec.axis == i``; for Linear and Conv2d it is the ``[d_out, d_in(+1)]``
matrix, with G on axis 0 and A on axis 1.  With ``vec`` stacking columns,
``(A⊗G) vec(X) = vec(G X A)`` for symmetric A, so every Kronecker-factored
operator is a sequence of per-axis matrix products (:func:`mul_axis`).

Where a layer's gradient matrix ``[∇W | ∇b]`` is the concatenation of its
parameters' own gradients, its first product can read them where they lie
(:func:`mul_axis_from`) and its last product can write straight into them
(:func:`mul_axis_to`): two gradient-sized copies fewer per layer and step
than assembling the matrix and copying ``V`` back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["mul_axis", "mul_axis_from", "mul_axis_to"]


def mul_axis(v: Tensor, m: Tensor, axis: int, out: Tensor | None = None) -> Tensor:
    """``out[..., j, ...] = Σ_i v[..., i, ...] m[i, j]`` along ``axis``.

    For a matrix: ``mᵀ v`` on axis 0 and ``v m`` on axis 1, written into
    ``out`` when given (a reused buffer, :mod:`kaisa.core.workspace`; it must not
    be ``v``).  Higher-order tensors ignore ``out``.
    """
    if m.dim() == 3:  # a stack of layers' matrices (kaisa.step.batched): [L, ...] each
        return m.transpose(-2, -1) @ v if axis == 0 else v @ m
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
