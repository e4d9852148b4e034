"""EKFAC: K-FAC with its eigenvalues corrected per example (George et al. 2018).

"Fast Approximate Natural Gradient Descent in a Kronecker-factored
Eigenbasis": with the eigenbases ``Q_A``, ``Q_G`` of the running factors, the
curvature's diagonal *in that basis* is estimated directly, as the running
second moment of the per-example gradient's coefficients::

    S = E_n[(Q_Gᵀ ∇Ŵ_n Q_A)²]          (elementwise square)
    V = Q_G [(Q_Gᵀ ∇ Q_A) / (S + γ)] Q_Aᵀ

where ``∇Ŵ_n = Σ_t ĝ_{n,t} ā_{n,t}ᵀ`` is example n's gradient summed over the
positions t that share the weight, its output gradients rescaled like G's
(``ĝ = m·g``: :mod:`kaisa.core.statistics`), so ``S`` is on the scale of
``λ_G λ_Aᵀ``, which is what K-FAC's eigen method divides by instead.

How it runs in kaisa — everything else is the eigen method's:

* **The statistic.**  :meth:`EKFACMethod.statistics` declares, beyond A and
  G, ``S``: a joint statistic of a call's input and output-gradient rows
  (:meth:`EKFACMethod.joint_term`, called by capture in the output's gradient
  hook), formed with the eigenbases the rank holds at that moment, counted
  in data points, and summed onto the layer's gradient workers, where it is
  folded with ``factor_decay`` into ``S`` in the method's state.  It needs
  the eigenbases on every rank that forms it, so it runs only where every
  rank is a gradient worker of every layer (``grad_worker_fraction=1``,
  COMM-OPT); other fractions are refused at construction
  (:func:`kaisa.wiring.check_method_plan`).
* **Before the first decomposition** there is no basis: no term is formed
  (a call adds nothing and counts nothing), and the first decomposition sets
  ``S = λ_G λ_Aᵀ`` — the eigen method's divisor.
* **At each decomposition** (an inverse update, or a recompute after loading
  a checkpoint without second-order tensors) the bases change and ``S``
  restarts from ``λ_G λ_Aᵀ`` of the new factors (a decomposition that
  failed keeps the previous bases, and ``S`` with them): the K-FAC estimate of the
  same diagonal, which the following factor steps' per-example statistics
  then correct (averaged in with ``factor_decay``).  A term formed with the
  old bases on the step of an inverse update is folded and then replaced by
  the restart.  So with ``inv_update_steps == factor_update_steps`` EKFAC is
  the eigen method; it pays off with several factor steps per basis, as the
  defaults (10 and 100) have.
* **Checkpoints.**  ``S`` is second-order state (meaningless without its
  bases): ``state_dict(include_second_order=True)`` saves it with them and a
  load restores both; without them, the bases are recomputed and ``S``
  restarts.
* **Layer types.**  The statistic is declared for layers whose factors are
  an input factor on the gradient matrix's columns and an output-gradient
  factor on its rows (every built-in type); dense, diagonal (its own basis)
  and block-diagonal factors alike.  Other layouts hold ``S = λ⊗λ`` only:
  the eigen method.  A layer called several times in one pass adds each
  call's per-example gradients separately.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from kaisa.core.decompose import eigen_outer
from kaisa.core.specs import (
    FactorKind,
    FactorSource,
    FactorSpec,
    ReducedTo,
    StatisticDtype,
    StatisticSpec,
)
from kaisa.core.workspace import Workspace, products_into
from kaisa.methods.base import Factors, HeldTensor, LayerView, Transfer, mul_factor
from kaisa.methods.eigen import EigenBasis, _apply_keys, _basis, _grad_shape, _own, _values

__all__ = ["EKFACMethod"]

#: the key of the running second moment in the eigenbasis (state and statistic)
_S = "ekfac_s"
#: per-example coefficient entries formed at once (a chunk of ``[n, d_G, d_A]``)
_CHUNK = 1 << 22


def _pair(factors: Factors) -> tuple[FactorSpec, FactorSpec] | None:
    """(A, G) where the layer is one input factor on axis 1 and one
    output-gradient factor on axis 0; None for other layouts."""
    if len(factors) != 2:
        return None
    by_axis = sorted(factors, key=lambda s: s.axis)
    g, a = by_axis
    if (g.axis, g.source, a.axis, a.source) != (0, FactorSource.OUTPUT_GRAD, 1, FactorSource.INPUT):
        return None
    return a, g


def _project(rows: Tensor, spec: FactorSpec, state: Mapping[str, Tensor]) -> Tensor:
    """``[batch, shared, d]`` rows' coefficients in the factor's eigenbasis
    (``rows @ Q``; a diagonal factor's basis is the identity)."""
    if spec.kind is FactorKind.DIAGONAL:
        return rows
    q = state[_basis(spec).key]
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        return spec.layout.mul(rows, q, -1)
    return rows @ q


def second_moment(g: Tensor, a: Tensor) -> Tensor:
    """``Σ_n (Σ_t g_{n,t} a_{n,t}ᵀ)²`` (elementwise square) of ``[batch,
    shared, d_G]`` and ``[batch, shared, d_A]`` coefficients: with one
    position, ``(g²)ᵀ (a²)`` (no per-example matrix is formed); else the
    per-example matrices in chunks of at most ``_CHUNK`` entries."""
    n, t, dg = g.shape
    da = a.shape[-1]
    if t == 1:
        return (g[:, 0] * g[:, 0]).t() @ (a[:, 0] * a[:, 0])
    out = g.new_zeros(dg, da)
    step = max(1, _CHUNK // max(1, dg * da))
    for start in range(0, n, step):
        per_example = torch.bmm(g[start : start + step].transpose(1, 2), a[start : start + step])
        out += per_example.square_().sum(0)
    return out


class EKFACMethod(EigenBasis):
    """Eigenvalue-corrected K-FAC: the eigen method's bases, divided by a
    running per-example second moment ``S`` instead of ``λ_G λ_Aᵀ``.

    :meth:`apply` only (no capability): its divisor ``S`` is not checked
    stacked (:mod:`kaisa.step.batched`) nor in column blocks."""

    name = "ekfac"
    kernel = "eigh"
    products_per_factor = 2

    def __init__(self) -> None:
        # the eigenvalues are kept: each decomposition restarts S from them
        super().__init__(outer_product=False)

    @classmethod
    def from_options(cls, *, outer_product: bool) -> EKFACMethod:
        return cls()

    def statistics(self, factors: Factors) -> tuple[StatisticSpec, ...]:
        declared = super().statistics(factors)
        pair = _pair(factors)
        if pair is None:
            return declared
        a, g = pair
        joint = StatisticSpec(
            _S,
            FactorSource.JOINT,
            (g.dim, a.dim),
            ReducedTo.WORKERS,
            StatisticDtype.SECOND_ORDER,
            needs_state=True,
            # per row: both projections, and its share of the per-example products
            flop_per_row=2.0 * (g.dim * g.dim + a.dim * a.dim + g.dim * a.dim),
        )
        return (*declared, joint)

    def joint_term(
        self,
        statistic: StatisticSpec,
        layer: LayerView,
        a_rows: Tensor,
        g_rows: Tensor,
        scale: float | Tensor,
        dtype: torch.dtype,
    ) -> Tensor | None:
        state = layer.state
        pair = _pair(layer.factors)
        if pair is None or _S not in state:
            return None  # no eigenbasis yet (before the first decomposition)
        a, g = pair
        with torch.autocast(a_rows.device.type, enabled=False):
            a_coeffs = _project(a_rows.to(dtype), a, state)
            g_coeffs = _project(g_rows.to(dtype), g, state)
            term = second_moment(g_coeffs, a_coeffs)
        return term.mul_(scale)

    def transfers(self, factors: Factors, colocated: bool) -> tuple[Transfer, ...]:
        if colocated:
            own = tuple(t for s in factors for t in _own(s))
            return (Transfer(tuple(range(len(factors))), own),)
        return super().transfers(factors, colocated)

    def held(self, factors: Factors, colocated: bool) -> tuple[HeldTensor, ...]:
        own = tuple(t for s in factors for t in _own(s))
        return (*own, HeldTensor(_S, _grad_shape(factors)))

    def receive(self, layer: LayerView, new: Mapping[str, Tensor]) -> None:
        """New bases drop ``S`` (expressed in the old ones) for :meth:`complete`
        to restart; a decomposition that kept the previous ones (it failed on
        its owner, which sends them again) keeps ``S`` too.  Decided by the
        values, which every worker holds alike, so the ranks decide alike."""
        state = layer.state
        if any(k not in state or not torch.equal(state[k], v) for k, v in new.items()):
            state.pop(_S, None)
        super().receive(layer, new)

    def complete(self, layer: LayerView, damping: float, colocated: bool) -> None:
        """New bases: ``S`` restarts from ``λ_G λ_Aᵀ`` (in axis order)."""
        state = layer.state
        if _S in state:
            return  # the bases were kept: S goes on in them
        ordered = sorted(layer.factors, key=lambda s: s.axis)
        state[_S] = eigen_outer([state[_values(s).key] for s in ordered]).clone()

    def fallback(self, tensor: HeldTensor, n_factors: int, damping: float, like: Tensor) -> Tensor:
        if tensor.key == _S:
            return torch.zeros(tensor.shape, dtype=like.dtype, device=like.device)
        return super().fallback(tensor, n_factors, damping, like)

    def apply(
        self, layer: LayerView, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        state = layer.state
        dense, _ = _apply_keys(layer.factors)
        s = state[_S]
        v = grad.to(s.dtype)
        outs = products_into(work, v)
        for spec, key in dense:
            v = mul_factor(v, spec, state[key], outs.next())
        v = torch.div(v, s + damping, out=outs.next())
        for spec, key in dense:
            v = mul_factor(v, spec, state[key], outs.next(), transpose=True)
        return v.to(grad.dtype)
