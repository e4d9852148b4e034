"""One layer's preconditioned gradient on its worker: the products every
write path (per layer, in place, stacked stand-ins) computes the same way.

A layer never decomposed gets damping-only stand-ins first
(:meth:`~kaisa.methods.base.CurvatureMethod.fill_missing`), so it
preconditions like the others; the products are timed while a profile is
attached; and whether the layer's ``⟨V, ∇⟩`` counts in this rank's KL sum
is the engine's call where layers are split over model-parallel ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.core.workspace import Workspace
from kaisa.distributed.plan import WorkPlan
from kaisa.engines.base import ModelParallelLayers
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod, LayerView, Operands
from kaisa.step.profile import PRODUCTS, StepProfile, factor_sizes

__all__ = ["LayerProducts", "Result"]

#: a layer's ``V`` (None: already written back, to be scaled by ``ν``) and its
#: ``⟨V, ∇⟩`` (None: written, and not counted in this rank's KL sum)
Result = tuple[Tensor | None, Tensor | None]


class LayerProducts:
    """``V`` of one layer on a gradient worker.

    Args:
        plan: the work plan (which tensors a layer's workers hold).
        method: the curvature method.
        model_parallel: the engine, where it splits layers over
            model-parallel ranks (it says which layers count in the KL sum).
    """

    def __init__(
        self,
        plan: WorkPlan,
        method: CurvatureMethod,
        model_parallel: ModelParallelLayers | None,
    ) -> None:
        self.plan = plan
        self.method = method
        self._model_parallel = model_parallel
        #: the products' wall times, while attached (:mod:`kaisa.step.profile`)
        self.profile: StepProfile | None = None

    def ready(self, layer: KFACLayer, damping: float) -> None:
        """Damping-only stand-ins for what ``layer`` was never given."""
        colocated = self.plan.layer(layer.name).colocated
        if not self.method.ready(layer, colocated):
            held = self.method.held(layer.factors, colocated)
            like = torch.empty(0, dtype=layer.inv_dtype, device=layer.adapter.device)
            self.method.fill_missing(layer, held, damping, like)

    def apply(
        self, layer: KFACLayer, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        """``V`` of ``layer``'s gradient matrix ``grad`` (its products in
        ``work``'s buffers where given)."""
        self.ready(layer, damping)
        operands = self.operands(layer)
        profile = self.profile
        if profile is None:
            return self.method.apply(operands, grad, damping, work)
        since = profile.start()
        v = self.method.apply(operands, grad, damping, work)
        profile.stop(PRODUCTS, since)
        profile.record(PRODUCTS, "products", grad.shape, factor_sizes(layer.factors))
        return v

    @staticmethod
    def operands(layer: KFACLayer) -> LayerView:
        """What the method applies: the layer itself, or a view of its cast
        copies where ``precondition_dtype`` differs (no object built per
        layer and step in the common case)."""
        tensors = layer.operands()
        return layer if tensors is layer.state else Operands(layer.factors, tensors)

    def counted(self, layer: KFACLayer) -> bool:
        """Whether ``layer``'s ``⟨V, ∇⟩`` counts in this rank's KL sum."""
        return self._model_parallel is None or self._model_parallel.counts_in_kl(layer.adapter)
