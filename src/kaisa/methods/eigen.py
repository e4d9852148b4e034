"""Eigen method: ``(F_0 ⊗ F_1 ⊗ … + γI)⁻¹ ∇`` exactly, from eigendecompositions.

For A and G: ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``.  A dense
factor contributes an eigenbasis ``q<name>`` and eigenvalues ``eig_<name>``;
a diagonal factor is its own eigenvalues (identity basis).  With
``outer_product`` the divisor ``inv_outer = 1/(λ_G λ_Aᵀ + γ)`` is formed once
per decomposition — by the owner when the factors are colocated (and sent
instead of the eigenvalues), by every worker once both halves have arrived
otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Self

import torch
from torch import Tensor

from kaisa.core.decompose import block_eigh, eigen_outer, symmetric_eigh
from kaisa.core.kronecker import mul_axis, mul_axis_from, mul_axis_to
from kaisa.core.specs import FactorKind, FactorSpec
from kaisa.core.workspace import Alternating, Workspace, products_into
from kaisa.methods.base import (
    CurvatureMethod,
    Factors,
    HeldTensor,
    IdentityMemo,
    LayerView,
    Transfer,
    block_layout,
    mul_factor,
)

__all__ = ["EigenBasis", "EigenMethod"]

_OUTER = "inv_outer"


def _basis(spec: FactorSpec) -> HeldTensor:
    """A dense factor's eigenbasis, or a block-diagonal one's blocks' bases (flat)."""
    return HeldTensor(f"q{spec.name.lower()}", spec.shape, layout=block_layout(spec))


def _values(spec: FactorSpec) -> HeldTensor:
    return HeldTensor(f"eig_{spec.name.lower()}", (spec.dim,))


@IdentityMemo
def _apply_keys(
    factors: Factors, _: bool
) -> tuple[tuple[tuple[FactorSpec, str], ...], tuple[str, ...]]:
    """(factors with a basis — dense or block-diagonal — in axis order with
    their bases' keys, every factor's eigenvalues' key in axis order), once
    per layer."""
    ordered = sorted(factors, key=lambda s: s.axis)
    dense = tuple((s, _basis(s).key) for s in ordered if s.kind is not FactorKind.DIAGONAL)
    return dense, tuple(_values(s).key for s in ordered)


def _grad_shape(factors: Factors) -> tuple[int, ...]:
    return tuple(s.dim for s in sorted(factors, key=lambda s: s.axis))


def _own(spec: FactorSpec) -> tuple[HeldTensor, ...]:
    if spec.kind is FactorKind.DIAGONAL:
        return (_values(spec),)
    return (_basis(spec), _values(spec))


class EigenBasis(CurvatureMethod):
    """Eigendecompositions of every factor: what the eigen method and the
    methods working in its bases (EKFAC, EKFAC-Adam) hold and produce.  Each
    says how it applies them; the capabilities are :class:`EigenMethod`'s."""

    def __init__(self, outer_product: bool = True) -> None:
        self.outer_product = outer_product

    @classmethod
    def from_options(cls, *, outer_product: bool) -> Self:
        return cls(outer_product=outer_product)

    def transfers(self, factors: Factors, colocated: bool) -> tuple[Transfer, ...]:
        if colocated:
            return (Transfer(tuple(range(len(factors))), self.held(factors, True)),)
        return tuple(Transfer((i,), _own(spec)) for i, spec in enumerate(factors))

    def held(self, factors: Factors, colocated: bool) -> tuple[HeldTensor, ...]:
        outer = HeldTensor(_OUTER, _grad_shape(factors))
        if colocated and self.outer_product:
            return (*(_basis(s) for s in factors if s.kind is not FactorKind.DIAGONAL), outer)
        own = tuple(t for s in factors for t in _own(s))
        return (*own, outer) if self.outer_product else own

    def decompose(
        self,
        layer: LayerView,
        which: tuple[int, ...],
        damping: float,
        dtype: torch.dtype,
        exchanged: Tensor | None,
    ) -> dict[str, Tensor]:
        factors = layer.factors
        new: dict[str, Tensor] = {}
        for i in which:
            spec, factor = factors[i], layer.running[i]
            assert factor is not None, f"factor {spec.name} is not held by its owner"
            if spec.kind is FactorKind.DIAGONAL:
                new[_values(spec).key] = factor.to(dtype).clamp(min=0.0)
            elif spec.kind is FactorKind.BLOCK_DIAGONAL:
                q, lam = block_eigh(factor, spec.layout, dtype)
                new[_basis(spec).key], new[_values(spec).key] = q, lam
            else:
                q, lam = symmetric_eigh(factor, dtype)
                new[_basis(spec).key], new[_values(spec).key] = q, lam
        if self.outer_product and len(which) == len(factors):
            new[_OUTER] = self._outer(factors, new, damping)
            for spec in factors:
                new.pop(_values(spec).key)
        return new

    @staticmethod
    def _outer(factors: Factors, state: dict[str, Tensor], damping: float) -> Tensor:
        ordered = sorted(factors, key=lambda s: s.axis)
        return 1.0 / (eigen_outer([state[_values(s).key] for s in ordered]) + damping)

    def complete(self, layer: LayerView, damping: float, colocated: bool) -> None:
        # The eigenvalues are kept (they are small) so that a later failed
        # decomposition of one factor can fall back to its previous values.
        factors, state = layer.factors, layer.state
        received = all(_values(s).key in state for s in factors)
        if self.outer_product and not colocated and received:
            state[_OUTER] = self._outer(factors, state, damping)

    def fallback(self, tensor: HeldTensor, n_factors: int, damping: float, like: Tensor) -> Tensor:
        if tensor.key == _OUTER:
            return torch.full(tensor.shape, 1.0 / damping, dtype=like.dtype, device=like.device)
        if tensor.key.startswith("eig_"):
            return torch.zeros(tensor.shape, dtype=like.dtype, device=like.device)
        if tensor.layout is not None:
            return tensor.layout.eye(like.dtype, like.device)
        return torch.eye(tensor.shape[0], dtype=like.dtype, device=like.device)


class EigenMethod(EigenBasis):
    """Eigendecompositions of every factor; exact damped Kronecker inverse.

    Capabilities (:mod:`kaisa.methods.capabilities`): stacked layers (every
    product goes through ``mul_axis``) and column blocks (for two dense
    factors, ``⟨V, ∇⟩`` formed in the eigenbasis)."""

    name = "eigen"

    def apply(
        self, layer: LayerView, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        state = layer.state
        dense, values = _apply_keys(layer.factors)
        # the dtype the products run in: a basis's, else (every factor
        # diagonal) the divisor's or the eigenvalues'
        some = state[dense[0][1] if dense else (_OUTER if _OUTER in state else values[0])]
        v = grad.to(some.dtype)
        outs = products_into(work, v)
        for spec, key in dense:
            v = mul_factor(v, spec, state[key], outs.next())
        v = _divide(v, state, values, damping, outs.next())
        for spec, key in dense:
            v = mul_factor(v, spec, state[key], outs.next(), transpose=True)
        return v.to(grad.dtype)

    def apply_stacked(self, layer: LayerView, grad: Tensor, damping: float) -> Tensor:
        """:meth:`apply`: its products batch over a leading dimension as they are."""
        return self.apply(layer, grad, damping)

    #: in the eigenbasis ``⟨V, ∇⟩ = ⟨C / D, C⟩`` with ``C = Q_Gᵀ ∇ Q_A``: both
    #: are in the workspace when the division is done (the bases are orthogonal)
    forms_kl_term = True

    def writes_blocks(self, layer: LayerView, dtype: torch.dtype) -> bool:
        dense, _ = _apply_keys(layer.factors)
        return (
            len(layer.factors) == 2
            and bool(dense)
            and all(s.kind is FactorKind.DENSE for s, _ in dense)
            and all(t.dtype == dtype for t in layer.state.values())
        )

    def apply_blocks(
        self,
        layer: LayerView,
        grad: Sequence[Tensor],
        damping: float,
        work: Workspace,
        out: Sequence[Tensor],
        kl: bool,
    ) -> Tensor | None:
        state = layer.state
        dense, values = _apply_keys(layer.factors)
        shape = (grad[0].shape[0], sum(b.shape[1] for b in grad))
        outs = Alternating(work, shape, grad[0].dtype)
        (first, key), *rest = dense
        coeffs = mul_axis_from(grad, state[key], first.axis, outs.buffer())
        for spec, key in rest:
            coeffs = mul_axis(coeffs, state[key], spec.axis, outs.next())
        v = _divide(coeffs, state, values, damping, outs.next())
        dot = torch.vdot(v.reshape(-1), coeffs.reshape(-1)) if kl else None
        *back, (last, key) = dense
        for spec, k in back:
            v = mul_axis(v, state[k].t(), spec.axis, outs.next())
        mul_axis_to(v, state[key].t(), last.axis, out)
        return dot


def _divide(
    coeffs: Tensor,
    state: Mapping[str, Tensor],
    values: tuple[str, ...],
    damping: float,
    out: Tensor | None,
) -> Tensor:
    """The coefficients in the eigenbasis divided by ``λ_G λ_Aᵀ + γ``."""
    if _OUTER in state:
        return torch.mul(coeffs, state[_OUTER], out=out)
    divisor = eigen_outer([state[k] for k in values]) + damping
    return torch.div(coeffs, divisor, out=out)
