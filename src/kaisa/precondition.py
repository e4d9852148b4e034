"""Applying the Kronecker-factored inverse to a gradient, and the KL clip.

All functions take the canonical ``[d_out, d_in(+1)]`` gradient matrix.  With
``vec`` stacking columns, ``(A⊗G) vec(X) = vec(G X A)`` for symmetric A, so:

* eigen:   ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ = (A⊗G + γI)⁻¹ ∇``
* inverse: ``V = (G + √γ/π I)⁻¹ ∇ (A + π√γ I)⁻¹
  = ((A + π√γ I) ⊗ (G + √γ/π I))⁻¹ ∇``

The math runs in the decomposition dtype and is cast back to the gradient's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["kl_clip_scale", "precondition_eigen", "precondition_inverse"]


def precondition_eigen(
    grad: Tensor,
    qa: Tensor,
    qg: Tensor,
    *,
    inv_outer: Tensor | None = None,
    eig_a: Tensor | None = None,
    eig_g: Tensor | None = None,
    damping: float | None = None,
) -> Tensor:
    """``(A⊗G + γI)⁻¹ ∇`` from the eigendecompositions of A and G.

    Either ``inv_outer = 1/(λ_G λ_Aᵀ + γ)`` (precomputed at decomposition
    time) or ``eig_a``, ``eig_g`` and ``damping`` must be given.
    """
    g = grad.to(qa.dtype)
    v = qg.t() @ g @ qa
    if inv_outer is not None:
        v = v * inv_outer
    else:
        if eig_a is None or eig_g is None or damping is None:
            raise ValueError("precondition_eigen needs inv_outer or eig_a, eig_g and damping")
        v = v / (torch.outer(eig_g, eig_a) + damping)
    return (qg @ v @ qa.t()).to(grad.dtype)


def precondition_inverse(grad: Tensor, a_inv: Tensor, g_inv: Tensor) -> Tensor:
    """``G⁻¹ ∇ A⁻¹`` with already-damped inverses."""
    return (g_inv @ grad.to(a_inv.dtype) @ a_inv).to(grad.dtype)


def kl_clip_scale(
    preconditioned: Sequence[Tensor], grads: Sequence[Tensor], lr: float, kl_clip: float | None
) -> Tensor | None:
    """``ν = min(1, sqrt(kl_clip / |Σ lr²⟨V, ∇⟩|))`` as a 0-d tensor; no host sync.

    Returns ``None`` when clipping is off.  A zero inner product gives ν = 1.
    """
    if kl_clip is None or not preconditioned:
        return None
    dots = torch.stack(
        [
            torch.vdot(v.reshape(-1), g.reshape(-1).to(v.dtype))
            for v, g in zip(preconditioned, grads)
        ]
    )
    vg = dots.sum().abs() * (lr * lr)
    return torch.clamp(torch.sqrt(kl_clip / vg), max=1.0)
