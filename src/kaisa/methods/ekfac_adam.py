"""Adam in K-FAC's eigenbasis: the K-FAC analogue of SOAP.

SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using
Adam") runs Adam in the eigenbasis of Shampoo's factors.  This method runs it
in the eigenbasis ``Q_A``, ``Q_G`` of K-FAC's running factors — the bases the
eigen and EKFAC methods use (George et al. 2018 estimate the diagonal in
that basis from per-example gradients; here it is Adam's running second
moment of the mini-batch gradient, as in SOAP).  Every step, per layer::

    C = Q_Gᵀ ∇ Q_A                      (the gradient in the eigenbasis)
    m ← β₁ m + (1 − β₁) C               (omitted with β₁ = 0)
    v ← β₂ v + (1 − β₂) C²              (elementwise)
    t ← t + 1
    V = Q_G [ m̂ / (√v̂ + ε) ] Q_Aᵀ       (m̂ = m/(1 − β₁ᵗ), v̂ = v/(1 − β₂ᵗ); C for m̂ with β₁ = 0)

with one basis per factor in general (any number of dense, block-diagonal or
diagonal factors; a diagonal factor's basis is the identity).

As its own optimizer it needs fresh bases: on the text-lm task, factors
every 5 steps with ``factor_decay=0.8`` and bases every 10 reached the target
in fewer steps than 10/50 intervals did.

Choices, and why:

* **A new basis carries the moments over** (:meth:`EKFACAdamMethod.receive`,
  at every inverse update, per factor as its basis arrives).  With
  ``R = Q_oldᵀ Q_new`` for each factor, the first moment is rotated exactly
  (``m ← R_Gᵀ m R_A``: the same running average, in the new coordinates, as
  SOAP does), and the second moment is re-projected: ``v ← (R_G∘R_G)ᵀ v
  (R_A∘R_A)``, the second moments of the new coordinates if the old ones were
  independent with variances ``v``.  Where the new basis is the old one up to
  signs and order this is SOAP's own carry-over (SOAP keeps ``v`` per
  coordinate, matched by eigenvalue order); it keeps ``v ≥ 0`` and its sum,
  and never restarts the bias correction.  Before the first decomposition the
  basis is the identity (the damping-only stand-ins): the method is plain
  Adam on the layer until then, and those moments are rotated in too.
* **Damping does not enter.**  The eigenbasis of ``A + γI`` is that of
  ``A``, and the divisor is Adam's ``√v̂ + ε`` with ``ε`` the method's own
  option (``eps``, in the gradient's units; Tikhonov ``γ`` is in curvature
  units, on the scale of the factors' eigenvalues, and would swamp ``√v̂``).
  ``damping`` and its schedule are accepted and ignored by the step.
* **The KL clip is applied as configured, to what it now measures.**
  ``lr²·⟨V, ∇⟩ = lr²·Σ m̂ C/(√v̂ + ε)`` is no KL divergence: without
  momentum it is the step's squared length in Adam's metric
  ``diag(√v̂ + ε)`` in the eigenbasis.  Adam's normalisation already bounds
  each coordinate's step (by about ``lr``), so ``kl_clip=None`` is the
  setting to use; a clip, if given, bounds that length.
* **Base optimizer.**  ``V`` is a complete Adam direction.  As its own
  optimizer: ``torch.optim.SGD(lr=step size, momentum=0)``, whose
  ``weight_decay`` is then decoupled (it is added after kaisa preconditioned
  the gradient: ``p ← p − lr·(V + wd·p)``, AdamW's rule).  Under another
  optimizer (AdamW, SGD with momentum) that optimizer's own moments act on
  ``V``; ``betas=(0, β₂)`` then leaves momentum to it.  Parameters kaisa does
  not precondition (norms) get the base optimizer's plain step either way,
  so as its own optimizer they want a param group of their own (AdamW).
* **Where the state lives.**  ``m``, ``v`` and ``t`` are held by each
  layer's gradient workers, updated from the (averaged) gradient they
  precondition, so every worker of a layer holds the same moments: any
  ``grad_worker_fraction`` is supported (tested at 1 and 0.5 on 2 ranks).
  ``precondition_dtype`` is refused (the moments would be updated in a cast
  copy); checkpoints with ``include_second_order=True`` keep them with their
  bases, and a load without them restarts them.  A skipped step (non-finite
  gradients) updates nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from kaisa.core.specs import FactorKind, FactorSpec
from kaisa.core.workspace import Workspace, products_into
from kaisa.methods.base import Factors, HeldTensor, LayerView, Transfer, mul_factor
from kaisa.methods.eigen import EigenBasis, _apply_keys, _basis, _grad_shape, _own

__all__ = ["EKFACAdamMethod"]

#: the first moment, second moment and step count, in the eigenbasis
_M = "adam_m"
_V = "adam_v"
_T = "adam_t"


def _rotation(spec: FactorSpec, old: Tensor, new: Tensor) -> Tensor:
    """``Q_oldᵀ Q_new`` of a factor's bases (block by block for a
    block-diagonal factor, in its flat storage)."""
    if spec.kind is not FactorKind.BLOCK_DIAGONAL:
        return old.t() @ new
    out = torch.empty_like(new)
    for (_, o), (_, n), (_, r) in zip(
        spec.layout.views(old), spec.layout.views(new), spec.layout.views(out)
    ):
        torch.bmm(o.transpose(1, 2), n, out=r)
    return out


class EKFACAdamMethod(EigenBasis):
    """Adam's moments kept in the eigenbasis of K-FAC's factors (SOAP's
    recipe with K-FAC's curvature factors).

    Capability (:mod:`kaisa.methods.capabilities`): :class:`StatefulApply`,
    :meth:`apply` advances the moments (so it is not stacked: a stacked copy
    would lose them; and its divisor is Adam's, so no column blocks)."""

    name = "ekfac_adam"
    kernel = "eigh"
    products_per_factor = 2

    def __init__(self, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        beta1, beta2 = (float(b) for b in betas)
        for label, value in (("betas[0]", beta1), ("betas[1]", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"EKFACAdamMethod {label} must be in [0, 1); got {value}")
        if not eps > 0.0:
            raise ValueError(f"EKFACAdamMethod eps must be > 0; got {eps}")
        super().__init__(outer_product=False)
        self.betas = (beta1, beta2)
        self.eps = float(eps)

    @classmethod
    def from_options(cls, *, outer_product: bool) -> EKFACAdamMethod:
        return cls()

    def __repr__(self) -> str:
        return f"EKFACAdamMethod(betas={self.betas}, eps={self.eps})"

    def transfers(self, factors: Factors, colocated: bool) -> tuple[Transfer, ...]:
        if colocated:
            own = tuple(t for s in factors for t in _own(s))
            return (Transfer(tuple(range(len(factors))), own),)
        return super().transfers(factors, colocated)

    def held(self, factors: Factors, colocated: bool) -> tuple[HeldTensor, ...]:
        own = tuple(t for s in factors for t in _own(s))
        shape = _grad_shape(factors)
        first = (HeldTensor(_M, shape),) if self.betas[0] > 0.0 else ()
        return (*own, *first, HeldTensor(_V, shape), HeldTensor(_T, (1,)))

    def receive(self, layer: LayerView, new: Mapping[str, Tensor]) -> None:
        """Carry the moments into the new bases (module docstring), then
        take the new tensors.  A basis that did not change (a failed
        decomposition keeps the old one) rotates nothing."""
        state = layer.state
        if _V in state:
            for spec in layer.factors:
                if spec.kind is FactorKind.DIAGONAL:
                    continue
                key = _basis(spec).key
                old, fresh = state.get(key), new.get(key)
                if old is None or fresh is None or fresh is old:
                    continue
                r = _rotation(spec, old.to(fresh.dtype), fresh)
                if _M in state:
                    state[_M] = mul_factor(state[_M], spec, r, None)
                state[_V] = mul_factor(state[_V], spec, r.square(), None)
        state.update(new)

    def complete(self, layer: LayerView, damping: float, colocated: bool) -> None:
        """The first decomposition starts the moments at zero."""
        factors, state = layer.factors, layer.state
        like = state[_own(factors[0])[0].key]
        for t in self.held(factors, colocated):
            if t.key in (_M, _V, _T) and t.key not in state:
                state[t.key] = torch.zeros(t.shape, dtype=like.dtype, device=like.device)

    def fallback(self, tensor: HeldTensor, n_factors: int, damping: float, like: Tensor) -> Tensor:
        if tensor.key in (_M, _V, _T):
            return torch.zeros(tensor.shape, dtype=like.dtype, device=like.device)
        return super().fallback(tensor, n_factors, damping, like)

    def advanced_keys(self) -> frozenset[str]:
        """The moments and the step count :meth:`apply` advances."""
        return frozenset((_M, _V, _T) if self.betas[0] > 0.0 else (_V, _T))

    def apply(
        self, layer: LayerView, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        """One Adam step of the layer's moments; returns ``V``.  Updates
        ``m``, ``v`` and ``t`` in ``layer.state`` (the worker's own tensors)."""
        state = layer.state
        dense, _ = _apply_keys(layer.factors)
        beta1, beta2 = self.betas
        v_state, count = state[_V], state[_T]
        c = grad.to(v_state.dtype)
        outs = products_into(work, c)
        for spec, key in dense:
            c = mul_factor(c, spec, state[key], outs.next())
        count.add_(1.0)
        v_state.mul_(beta2).addcmul_(c, c, value=1.0 - beta2)
        # √v̂ + ε = √v / √(1 − β₂ᵗ) + ε
        denom = v_state.sqrt().div_(torch.sqrt(1.0 - torch.pow(beta2, count))).add_(self.eps)
        if beta1 > 0.0:
            m_state = state[_M]
            m_state.mul_(beta1).add_(c, alpha=1.0 - beta1)
            u = torch.div(m_state, denom, out=outs.next()).div_(1.0 - torch.pow(beta1, count))
        else:
            u = torch.div(c, denom, out=outs.next())
        for spec, key in dense:
            u = mul_factor(u, spec, state[key], outs.next(), transpose=True)
        return u.to(grad.dtype)
