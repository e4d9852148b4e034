"""Grafting: K-FAC's direction with another method's step size, per layer.

Distributed Shampoo (Anil et al. 2020; Shi et al. 2023) grafts the
layer-wise step size of a first-order method onto its preconditioned
direction.  :class:`GraftedMethod` does the same for any curvature method:
per layer, with ``V`` the method's preconditioned gradient and ``∇`` the
layer's gradient matrix (weight and bias together, as kaisa preconditions
them)::

    V ← V · ‖D(∇)‖_F / ‖V‖_F

    sgd:   D(∇) = ∇
    adam:  v ← β₂ v + (1 − β₂) ∇²;  t ← t + 1;  D(∇) = ∇ / (√(v / (1 − β₂ᵗ)) + ε)

so K-FAC chooses the direction and the grafting method the length.  ``v`` is
an exponential moving average of the squared gradient kept per layer (the
first moment is not: momentum is the base optimizer's, applied to the
grafted ``V``); β₂ = 0.999 and ε = 1e-8 are Adam's (and AdamW's) defaults.

Choices, and why:

* **Per kaisa layer**, not per parameter: ``V`` of a layer with a bias is one
  matrix ``[V_W | V_b]``, rescaled as a whole (Shampoo grafts per parameter
  block; kaisa's block is the layer).
* **The KL clip acts after grafting**, on what is then written: ``ν`` is
  formed from ``⟨V_grafted, ∇⟩``, so a clip that is set still bounds the
  step actually taken.  With grafting the grafting method sets the size, so
  ``kl_clip=None`` is the setting to use (a clip then only shrinks it further).
* **Damping** still shapes the direction (it enters ``V``), not its length.
* **Base optimizer.**  With ``'sgd'`` or ``'adam'`` the grafted ``V`` has the
  length of an SGD or Adam step, so the base optimizer is plain SGD (with
  momentum if wanted), whose lr is then that method's lr.  Under AdamW the
  length is renormalised per coordinate by AdamW anyway (grafting changes
  only the relative size of its input across steps).
* **Where ``v`` lives.**  Like ``ekfac_adam``'s moments: a held tensor of the
  layer's gradient workers, updated from the (averaged) gradient they
  precondition, so every worker of a layer holds the same ``v`` under any
  ``grad_worker_fraction``; checkpointed with the second-order state
  (``include_second_order=True``), restarted at zero when a checkpoint lacks
  it.  ``precondition_dtype`` is refused with ``'adam'`` (``v`` would be
  updated in a cast copy).
* **No host synchronisation**: the norms and the scale stay tensors.  A layer
  whose ``V`` is zero stays zero.  The column-block (in-place) write path is
  not taken: the norm of ``∇`` is needed after ``V`` is formed.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from kaisa.config import Grafting
from kaisa.core.specs import StatisticSpec
from kaisa.core.workspace import Workspace
from kaisa.methods.base import CurvatureMethod, Factors, HeldTensor, LayerView, Transfer
from kaisa.methods.capabilities import StatefulApply
from kaisa.methods.eigen import _grad_shape

__all__ = ["GraftedMethod"]

#: the grafting method's running second moment of the gradient and its step count
_V = "graft_v"
_T = "graft_t"


class GraftedMethod(CurvatureMethod):
    """``base``'s direction, each layer's length taken from ``grafting``'s direction.

    Composition: every declaration and decomposition is the base's; ``held``
    adds the grafting state and :meth:`apply` rescales the base's ``V``.  So
    the planner, which resolves the same wrapper
    (:func:`kaisa.methods.resolve_method`), counts the grafting state too.
    Capabilities: :class:`~kaisa.methods.capabilities.StatefulApply` where
    :meth:`advanced_keys` names any (``'adam'``, or a base that has its own);
    neither stacked nor column blocks (the norm of ``∇`` is needed once ``V``
    is formed)."""

    def __init__(
        self,
        base: CurvatureMethod,
        grafting: Grafting | str,
        beta2: float = 0.999,
        eps: float = 1e-8,
    ) -> None:
        if isinstance(base, GraftedMethod):
            raise ValueError("GraftedMethod base must not itself be grafted")
        allowed = {g.value: g for g in Grafting}
        kind = allowed.get(grafting.value if isinstance(grafting, Grafting) else grafting)
        if kind is None:
            raise ValueError(f"grafting must be one of 'sgd', 'adam'; got {grafting!r}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"GraftedMethod beta2 must be in [0, 1); got {beta2}")
        if not eps > 0.0:
            raise ValueError(f"GraftedMethod eps must be > 0; got {eps}")
        self.base = base
        self.grafting = kind
        self.beta2 = float(beta2)
        self.eps = float(eps)
        # what the step and the planner read of a method: the base's
        self.name = base.name
        self.kernel = base.kernel
        self.products_per_factor = base.products_per_factor

    def __repr__(self) -> str:
        return f"GraftedMethod({self.base!r}, grafting={self.grafting.value!r})"

    # -- delegated to the base method -------------------------------------------------
    def statistics(self, factors: Factors) -> tuple[StatisticSpec, ...]:
        return self.base.statistics(factors)

    def joint_term(
        self,
        statistic: StatisticSpec,
        layer: LayerView,
        a_rows: Tensor,
        g_rows: Tensor,
        scale: float | Tensor,
        dtype: torch.dtype,
    ) -> Tensor | None:
        return self.base.joint_term(statistic, layer, a_rows, g_rows, scale, dtype)

    def transfers(self, factors: Factors, colocated: bool) -> tuple[Transfer, ...]:
        return self.base.transfers(factors, colocated)

    def exchange(self, layer: LayerView) -> Tensor | None:
        return self.base.exchange(layer)

    def decompose(
        self,
        layer: LayerView,
        which: tuple[int, ...],
        damping: float,
        dtype: torch.dtype,
        exchanged: Tensor | None,
    ) -> dict[str, Tensor]:
        return self.base.decompose(layer, which, damping, dtype, exchanged)

    def receive(self, layer: LayerView, new: Mapping[str, Tensor]) -> None:
        self.base.receive(layer, new)

    def complete(self, layer: LayerView, damping: float, colocated: bool) -> None:
        self.base.complete(layer, damping, colocated)

    # -- the grafting state -------------------------------------------------------------
    def held(self, factors: Factors, colocated: bool) -> tuple[HeldTensor, ...]:
        own = self.base.held(factors, colocated)
        if self.grafting is Grafting.SGD:
            return own
        return (*own, HeldTensor(_V, _grad_shape(factors)), HeldTensor(_T, (1,)))

    def fallback(self, tensor: HeldTensor, n_factors: int, damping: float, like: Tensor) -> Tensor:
        if tensor.key in (_V, _T):
            return torch.zeros(tensor.shape, dtype=like.dtype, device=like.device)
        return self.base.fallback(tensor, n_factors, damping, like)

    def advanced_keys(self) -> frozenset[str]:
        """The base's (where it advances any) and, with ``'adam'``, ``v`` and ``t``."""
        base = self.base.advanced_keys() if isinstance(self.base, StatefulApply) else frozenset()
        return (base | {_V, _T}) if self.grafting is Grafting.ADAM else base

    def apply(
        self, layer: LayerView, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        """The base method's ``V``, rescaled in place to ``‖D(∇)‖_F``
        (updates ``v`` and ``t`` in ``layer.state`` with ``'adam'``)."""
        v = self.base.apply(layer, grad, damping, work)
        target = self._graft_norm(layer.state, grad)
        length = torch.linalg.vector_norm(v, dtype=target.dtype)
        tiny = torch.finfo(target.dtype).tiny
        return v.mul_((target / length.clamp_min(tiny)).to(v.dtype))

    def _graft_norm(self, state: Mapping[str, Tensor], grad: Tensor) -> Tensor:
        """``‖D(∇)‖_F`` as a 0-d tensor (float32 at least)."""
        if self.grafting is Grafting.SGD:
            dtype = torch.promote_types(grad.dtype, torch.float32)
            return torch.linalg.vector_norm(grad, dtype=dtype)
        second, count = state[_V], state[_T]
        g = grad.to(second.dtype)
        count.add_(1.0)
        second.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        # √v̂ + ε = √v / √(1 − β₂ᵗ) + ε
        denom = second.sqrt().div_(torch.sqrt(1.0 - torch.pow(self.beta2, count))).add_(self.eps)
        return torch.linalg.vector_norm(g / denom)
