"""Inverse method: factored Tikhonov damping with the π-split.

Each factor is inverted with its share of the damping, ``(F_i + γ^{1/N} π_i
I)⁻¹`` with ``∏ π_i = 1`` (Martens & Grosse 2015, §6.3; for A and G:
``A + π√γ I`` and ``G + (√γ/π) I``), and ``V = G⁻¹ ∇ A⁻¹``.  This is
cheaper than the eigen method (Cholesky instead of eigh) but only
approximates ``(A⊗G + γI)⁻¹``.  π needs every factor's trace: when a layer's
factors live on different ranks the traces are exchanged (:meth:`exchange`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kaisa.core.decompose import block_damped_inverse, damped_inverse, pi_splits
from kaisa.core.kronecker import mul_axis_from, mul_axis_to
from kaisa.core.specs import FactorKind, FactorSpec
from kaisa.core.workspace import Workspace, products_into
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

__all__ = ["InverseMethod"]


def _inverse(spec: FactorSpec) -> HeldTensor:
    # a diagonal factor's inverse is a vector: nothing to fold into a triangle
    return HeldTensor(
        f"{spec.name.lower()}_inv", spec.shape, spec.symmetric, layout=block_layout(spec)
    )


@IdentityMemo
def _apply_order(factors: Factors, _: bool) -> tuple[tuple[FactorSpec, str], ...]:
    """The factors in axis order with their inverses' keys (once per layer)."""
    return tuple((s, _inverse(s).key) for s in sorted(factors, key=lambda s: s.axis))


def _trace(spec: FactorSpec, factor: Tensor) -> Tensor:
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        diag = spec.layout.diagonal(factor)
    else:
        diag = factor if spec.kind is FactorKind.DIAGONAL else torch.diagonal(factor)
    return diag.to(torch.float64).sum()


class InverseMethod(CurvatureMethod):
    """Damped inverses of every factor.

    Capabilities (:mod:`kaisa.methods.capabilities`): stacked layers (every
    product goes through ``mul_axis``) and column blocks (two dense factors)."""

    name = "inverse"
    kernel = "inverse"  #: damped Cholesky inverses
    products_per_factor = 1  #: ``G⁻¹ ∇ A⁻¹``: one product per factor

    def transfers(self, factors: Factors, colocated: bool) -> tuple[Transfer, ...]:
        if colocated:
            return (Transfer(tuple(range(len(factors))), self.held(factors, True)),)
        return tuple(Transfer((i,), (_inverse(s),)) for i, s in enumerate(factors))

    def held(self, factors: Factors, colocated: bool) -> tuple[HeldTensor, ...]:
        return tuple(_inverse(s) for s in factors)

    def exchange(self, layer: LayerView) -> Tensor | None:
        running = layer.running
        device = next((t.device for t in running if t is not None), None)
        out = torch.zeros(len(layer.factors), dtype=torch.float64, device=device)
        for i, (spec, factor) in enumerate(zip(layer.factors, running)):
            if factor is not None:
                out[i] = _trace(spec, factor)
        return out

    def decompose(
        self,
        layer: LayerView,
        which: tuple[int, ...],
        damping: float,
        dtype: torch.dtype,
        exchanged: Tensor | None,
    ) -> dict[str, Tensor]:
        assert exchanged is not None
        factors, running = layer.factors, layer.running
        pis = pi_splits(exchanged, [s.dim for s in factors])
        share = damping ** (1.0 / len(factors))
        new: dict[str, Tensor] = {}
        for i in which:
            spec, factor = factors[i], running[i]
            assert factor is not None, f"factor {spec.name} is not held by its owner"
            shift = pis[i] * share
            if spec.kind is FactorKind.DIAGONAL:
                new[_inverse(spec).key] = 1.0 / (factor.to(dtype) + shift.to(dtype))
            elif spec.kind is FactorKind.BLOCK_DIAGONAL:
                new[_inverse(spec).key] = block_damped_inverse(factor, spec.layout, shift, dtype)
            else:
                new[_inverse(spec).key] = damped_inverse(factor, shift, dtype)
        return new

    def fallback(self, tensor: HeldTensor, n_factors: int, damping: float, like: Tensor) -> Tensor:
        value = damping ** (-1.0 / n_factors)
        if tensor.layout is not None:
            return tensor.layout.eye(like.dtype, like.device) * value
        if len(tensor.shape) == 1:
            return torch.full(tensor.shape, value, dtype=like.dtype, device=like.device)
        return torch.eye(tensor.shape[0], dtype=like.dtype, device=like.device) * value

    def apply(
        self, layer: LayerView, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        state = layer.state
        order = _apply_order(layer.factors)
        v = grad.to(state[order[0][1]].dtype)
        outs = products_into(work, v)
        for spec, key in order:
            v = _apply_factor(v, spec, state[key], outs.next())
        return v.to(grad.dtype)

    def apply_stacked(self, layer: LayerView, grad: Tensor, damping: float) -> Tensor:
        """:meth:`apply`: its products batch over a leading dimension as they are."""
        return self.apply(layer, grad, damping)

    #: ``G⁻¹ ∇ A⁻¹`` passes through no basis where ``⟨V, ∇⟩`` is at hand
    forms_kl_term = False

    def writes_blocks(self, layer: LayerView, dtype: torch.dtype) -> bool:
        order = _apply_order(layer.factors)
        return (
            len(order) == 2
            and all(spec.kind is FactorKind.DENSE for spec, _ in order)
            and all(layer.state[key].dtype == dtype for _, key in order)
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
        (first, first_key), (last, last_key) = _apply_order(layer.factors)
        shape = (grad[0].shape[0], sum(b.shape[1] for b in grad))
        v = mul_axis_from(
            grad, state[first_key], first.axis, work.take("ping", shape, grad[0].dtype)
        )
        mul_axis_to(v, state[last_key], last.axis, out)
        return None


def _apply_factor(v: Tensor, spec: FactorSpec, inv: Tensor, out: Tensor | None) -> Tensor:
    """One factor's inverse applied along its axis (a diagonal one elementwise)."""
    if spec.kind is FactorKind.DIAGONAL:
        shape = [1] * v.dim()
        shape[spec.axis] = -1
        return torch.mul(v, inv.reshape(shape), out=out)
    return mul_factor(v, spec, inv, out)
