"""Factor decompositions: eigendecompositions and damped inverses.

Pure functions on one symmetric positive semi-definite factor; the
orchestrator decides which rank calls them for which factor.  A failed or
non-finite decomposition raises :class:`DecompositionError` so the caller can
keep the previous (valid) decomposition instead of storing garbage.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.core.blocks import BlockLayout
from kaisa.core.statistics import all_finite, factor_finite

__all__ = [
    "DecompositionError",
    "block_damped_inverse",
    "block_eigh",
    "damped_inverse",
    "eigen_outer",
    "pi_splits",
    "symmetric_eigh",
]


class DecompositionError(RuntimeError):
    """A factor could not be decomposed (non-finite input or no convergence)."""


# Both decompositions read the lower triangle only (LAPACK's ``syevd`` and
# ``potrf`` with ``uplo='L'``, torch's defaults), and every factor is a
# symmetric Gram (to rounding), so the factor is handed over as it is: a
# symmetrising pass ``(F + Fᵀ)/2`` read the transpose with a stride of a
# whole row and cost 9% of an MLP's Cholesky inverses (0.56 ms for a
# 512 x 512 factor).


def symmetric_eigh(factor: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Eigenvectors ``Q`` and eigenvalues ``λ ≥ 0`` of a PSD factor (or of a
    batch ``[k, b, b]`` of them), in ``dtype``.

    Eigenvalues below zero are rounding noise of a PSD matrix and are clamped
    to zero.  If ``eigh`` does not converge in ``dtype`` it is retried once in
    float64 (results cast back) before giving up.
    """
    matrix = factor.to(dtype)  # eigh does not write its input
    if not bool(factor_finite(matrix)):
        raise DecompositionError("factor has non-finite entries")
    try:
        eigvals, eigvecs = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
        try:
            eigvals, eigvecs = torch.linalg.eigh(matrix.double())
        except RuntimeError as exc:
            raise DecompositionError(f"eigh failed: {exc}") from exc
        eigvals, eigvecs = eigvals.to(dtype), eigvecs.to(dtype)
    if not bool(all_finite(eigvals) & all_finite(eigvecs)):
        raise DecompositionError("eigh returned non-finite values")
    # eigh returns column-major vectors; a contiguous copy makes every later
    # matmul (and any received copy of it) round identically.
    return eigvecs.contiguous(), eigvals.clamp(min=0.0)


def eigen_outer(eigenvalues: list[Tensor]) -> Tensor:
    """``λ_0 ∘ λ_1 ∘ …``: the outer product of eigenvalue vectors, axis by axis
    (of each layer's, for vectors stacked ``[L, d]``: :mod:`kaisa.step.batched`)."""
    out = eigenvalues[0]
    for lam in eigenvalues[1:]:
        if lam.dim() == 2:
            out = out.unsqueeze(-1) * lam.reshape(lam.shape[0], *[1] * (out.dim() - 1), -1)
        else:
            out = torch.outer(out.reshape(-1), lam).reshape(*out.shape, lam.shape[0])
    return out


def pi_splits(traces: Tensor, dims: list[int]) -> Tensor:
    """Per-factor π_i of factored Tikhonov damping for N factors.

    With ``t_i = tr F_i / d_i``, ``π_i = t_i / (∏ t_j)^{1/N}`` (so ``∏ π_i =
    1``) and factor ``i`` is damped by ``γ^{1/N} π_i``; for two factors this is
    ``A + π√γ I``, ``G + (√γ/π) I`` with ``π = sqrt(t_A / t_G)``.  All ones when any
    trace is not positive or not finite (e.g., a dead layer).
    """
    means = traces.to(torch.float64) / torch.tensor(dims, dtype=torch.float64, device=traces.device)
    ok = bool(((means > 0) & torch.isfinite(means)).all())
    if not ok:
        return torch.ones_like(means)
    return means / torch.exp(torch.log(means).mean())


def damped_inverse(factor: Tensor, shift: float | Tensor, dtype: torch.dtype) -> Tensor:
    """``(F + shift·I)⁻¹`` in ``dtype`` via Cholesky, falling back to a
    general inverse; ``factor`` may be a batch ``[k, b, b]``."""
    matrix = factor.to(dtype, copy=True)  # the running factor is not shifted
    diagonal = matrix.diagonal(dim1=-2, dim2=-1)
    diagonal.add_(shift.to(dtype) if isinstance(shift, Tensor) else shift)
    if not bool(factor_finite(matrix)):
        raise DecompositionError("factor has non-finite entries")
    chol, info = torch.linalg.cholesky_ex(matrix)
    if not bool(info.any()):
        inverse = torch.cholesky_inverse(chol)
    else:
        try:
            inverse = torch.linalg.inv(matrix)
        except RuntimeError as exc:
            raise DecompositionError(f"inverse failed: {exc}") from exc
    if not bool(all_finite(inverse)):
        raise DecompositionError("inverse is non-finite")
    return inverse


def block_eigh(flat: Tensor, layout: BlockLayout, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`symmetric_eigh` of each diagonal block of a block-diagonal
    factor stored flat: the eigenbases flat in the same layout, and the ``d``
    eigenvalues in the axis's order (block by block), as a dense factor's."""
    bases, values = [], []
    for _, view in layout.views(flat):
        q, lam = symmetric_eigh(view, dtype)
        bases.append(q.reshape(-1))
        values.append(lam.reshape(-1))
    return torch.cat(bases), torch.cat(values)


def block_damped_inverse(
    flat: Tensor, layout: BlockLayout, shift: float | Tensor, dtype: torch.dtype
) -> Tensor:
    """:func:`damped_inverse` of each diagonal block, flat in the same layout
    (the inverse of a block-diagonal matrix is the blocks' inverses)."""
    return torch.cat([damped_inverse(v, shift, dtype).reshape(-1) for _, v in layout.views(flat)])
