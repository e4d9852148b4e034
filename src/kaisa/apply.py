"""Precondition → broadcast → scale → write back.

Gradient workers apply the curvature method to the layer's gradient; when
there are fewer workers than ranks (HYBRID-/MEM-OPT) each worker broadcasts
the result to its receiver group.  The KL clip's inner product is then
summed over the model-parallel groups (tensor and pipeline parallelism hold
other layers of the same model) before ``ν`` is formed, and ``ν·V`` is
written back through the engine.

Which layers take part is agreed on by every rank of the data-parallel group
(one small collective, skipped where the engine guarantees it, as DDP does):
a layer with no gradient on some rank this step is left alone on all of
them, so no rank waits for a broadcast that never comes.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from kaisa.comm import Communicator
from kaisa.engines.base import Engine
from kaisa.layer import KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.plan import WorkPlan
from kaisa.precondition import kl_inner, kl_scale
from kaisa.second_order import SecondOrderUpdate

__all__ = ["GradientApplication"]


class GradientApplication:
    """Writes ``ν·V`` into the gradients of the layers that have one."""

    def __init__(
        self,
        plan: WorkPlan,
        comm: Communicator,
        method: CurvatureMethod,
        engine: Engine,
        second_order: SecondOrderUpdate,
    ) -> None:
        self.plan = plan
        self.comm = comm
        self.method = method
        self.engine = engine
        self.second_order = second_order
        self.rank = comm.rank
        self._warned: set[str] = set()

    def run(
        self,
        layers: list[KFACLayer],
        damping: float,
        lr: float,
        kl_clip: float | None,
        factor_step: bool,
    ) -> None:
        grads = self._read(layers, factor_step)
        results = self._precondition(grads, damping)
        names = list(results)
        nu: Tensor | None = None
        if kl_clip is not None:
            inner = kl_inner([results[n] for n in names], [grads[n][1] for n in names])
            if self.comm.model_parallel:
                # every rank of a model-parallel group joins, with 0 if it has no layer
                device = layers[0].adapter.device
                total = torch.zeros((), dtype=torch.float64, device=device)
                inner = self.comm.sum_model_parallel(total if inner is None else total.add_(inner))
            if inner is not None:
                nu = kl_scale(inner, lr, kl_clip)
        for name in names:
            value = results[name] if nu is None else results[name].mul_(nu)
            self.engine.write(grads[name][0].adapter, value)

    def _read(
        self, layers: list[KFACLayer], factor_step: bool
    ) -> dict[str, tuple[KFACLayer, Tensor]]:
        """Gradients of captured layers, kept where every rank has one."""
        local: dict[str, tuple[KFACLayer, Tensor]] = {}
        for layer in layers:
            grad = self.engine.read(layer.adapter)
            if grad is None:
                continue
            if not layer.captured:
                if factor_step:
                    self._warn_once(
                        layer.name,
                        f"kaisa: layer {layer.name!r} has a gradient but its hooks never "
                        "captured statistics (is it called functionally?); its gradient is "
                        "left unchanged",
                    )
                continue
            local[layer.name] = (layer, grad)
        if not self.comm.distributed or self.engine.gradients_agree():
            return local
        candidates = [la for la in layers if la.captured]
        agreed = self.comm.agree_all(
            [la.name in local for la in candidates], layers[0].adapter.device
        )
        kept = {}
        for layer, ok in zip(candidates, agreed):
            if ok:
                kept[layer.name] = local[layer.name]
            elif layer.name in local:
                self._warn_once(
                    layer.name,
                    f"kaisa: layer {layer.name!r} has a gradient on some ranks only this step; "
                    "it is left unchanged on every rank (average gradients over all ranks, "
                    "e.g. with DDP(find_unused_parameters=True), to precondition it)",
                )
        return kept

    def _precondition(
        self, grads: dict[str, tuple[KFACLayer, Tensor]], damping: float
    ) -> dict[str, Tensor]:
        results: dict[str, Tensor] = {}
        for name, (layer, grad) in grads.items():
            lp = self.plan.layer(name)
            if self.rank in lp.grad_workers:
                if not self.method.ready(layer.factors, layer.state, lp.colocated):
                    held = self.method.held(layer.factors, lp.colocated)
                    self.second_order.fill_missing(layer, held, damping)
                results[name] = self.method.apply(layer.factors, layer.state, grad, damping)
            if self.plan.grad_workers < self.plan.world_size:
                group = lp.receiver_group_of(self.rank)
                src = group[0]
                buf = results[name] if self.rank == src else grad.new_empty(grad.shape)

                def store(received: list[Tensor], name: str = name) -> None:
                    results[name] = received[0]

                self.comm.broadcast(
                    [buf], src, group, None if self.rank == src else store, kind="grad_broadcast"
                )
        self.comm.wait()
        return results

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(message, stacklevel=5)
