"""Precondition → broadcast → scale → write back.

Gradient workers apply the curvature method to the layer's gradient; when
there are fewer workers than ranks (HYBRID-/MEM-OPT) each worker broadcasts
the result to its receiver group.  The KL clip's inner product is then
summed over the model-parallel groups (tensor and pipeline parallelism hold
other layers of the same model) before ``ν`` is formed, and ``ν·V`` is
written back through the engine.

Only a layer's gradient workers need its full gradient: the engine reads
all layers in one agreed order and may gather each onto its workers only
(DeepSpeed ZeRO keeps gradients partitioned).  So the KL clip's per-layer
term ``⟨V, ∇⟩`` is formed where ``V`` is, and travels with ``V`` to the
receivers, exactly as every rank would have computed it.

Which layers take part is agreed on by every rank of the data-parallel group
(one small collective, skipped where the engine guarantees it, as DDP does):
a layer with no gradient on some rank this step is left alone on all of
them, so no rank waits for a broadcast that never comes.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

from kaisa.core.kl_clip import kl_scale, kl_scale_value, kl_term
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.messages import grad_message
from kaisa.distributed.plan import LayerPlan, WorkPlan
from kaisa.engines.base import Engine, InPlaceGradients, ModelParallelLayers, ShardedReads
from kaisa.layers.base import LayerAdapter
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.step.batched import ShapeGroups
from kaisa.step.context import StepContext
from kaisa.step.diagnostics import StepDiagnostics
from kaisa.step.in_place import InPlaceWrites
from kaisa.step.participation import Participation
from kaisa.step.products import LayerProducts
from kaisa.step.profile import StepProfile

__all__ = ["GradientApplication"]


class GradientApplication:
    """Writes ``ν·V`` into the gradients of the layers that have one."""

    def __init__(
        self,
        plan: WorkPlan,
        comm: Communicator,
        method: CurvatureMethod,
        engine: Engine,
    ) -> None:
        self.plan = plan
        self.comm = comm
        self.method = method
        self.engine = engine
        # the engine's optional capabilities, asked once (None: it has not)
        self._in_place = engine if isinstance(engine, InPlaceGradients) else None
        self._sharded = engine if isinstance(engine, ShardedReads) else None
        self._model_parallel = engine if isinstance(engine, ModelParallelLayers) else None
        #: one layer's V, as every write path computes it (kaisa.step.products)
        self.products = LayerProducts(plan, method, self._model_parallel)
        #: layers of one shape preconditioned together (kaisa.step.batched)
        self.groups = ShapeGroups(method)
        self.rank = comm.rank
        #: which layers take part in a step (kaisa.step.participation)
        self.participation = Participation(comm, engine)
        self._globals: dict[int, tuple[int, ...]] = {}
        #: layers written before ν, the workspace of the large ones (kaisa.step.in_place)
        self.writes = InPlaceWrites(engine, self._in_place, self.products)
        #: filled with each step's ν only while set (:mod:`kaisa.step.diagnostics`)
        self.diagnostics: StepDiagnostics | None = None
        #: read scalars (ν's terms, the finiteness verdict) as numbers: None
        #: where that is free, on CPU; False keeps them on the device
        self.read_scalars: bool | None = None

    @property
    def profile(self) -> StepProfile | None:
        """The products' wall times, while attached (:mod:`kaisa.step.profile`)."""
        return self.products.profile

    @profile.setter
    def profile(self, value: StepProfile | None) -> None:
        self.products.profile = value

    def reads_free(self, device: torch.device) -> bool:
        """Whether a scalar on ``device`` is read as a number (:attr:`read_scalars`)."""
        return device.type == "cpu" if self.read_scalars is None else self.read_scalars

    @property
    def workspace_bytes(self) -> int:
        """Bytes held by the reused product buffers (:mod:`kaisa.core.workspace`)."""
        return self.writes.nbytes

    def run(self, layers: list[KFACLayer], ctx: StepContext) -> None:
        """Write ``ν·V`` for ``ctx``'s step.  ``ctx.presence``: each layer's
        gradient presence, already and-ed over the data-parallel group (by
        the finiteness check), so no second collective is needed to agree on it."""
        # a 0-d tensor inside a recorded step: the products take either
        damping = cast(float, ctx.damping)
        taking_part = self.participation.taking_part(layers, ctx.factor_step, ctx.presence)
        clip = ctx.clip
        work = self.writes.workspace(layers)
        own: list[KFACLayer] = []
        held = taking_part
        if work is not None and self.plan.grad_workers == self.plan.world_size:
            # every rank is every layer's worker: the layers that own their
            # parameters write each V at once (the large ones' products in the
            # workspace) and are scaled after; the others hold V until ν is known
            own = [la for la in taking_part if la.name in self.writes.own]
            held = [la for la in taking_part if la.name not in self.writes.own]
        groups = self._shape_groups(taking_part)
        if groups:  # stacked layers are held until ν, as the general path holds them
            grouped = {la.name for group in groups for la in group}
            own = [la for la in own if la.name not in grouped]
            held = [la for la in held if la.name not in grouped]
        profile = self.profile
        dots = (
            self.writes.write_each(own, work, damping, profile) if work is not None and own else {}
        )
        results = self._precondition(held, damping) if held else {}
        results.update(self._precondition_stacked(groups, damping))
        held = held + [la for group in groups for la in group]
        for name, (_, dot) in results.items():
            dots[name] = dot
        counted = [dots[la.name] for la in taking_part if self.products.counted(la)]
        nu = self._nu(counted, layers, clip)
        if self.diagnostics is not None:
            self.diagnostics.record_kl_scale(nu)
        if self._in_place is not None:
            # held layers that own their parameters: written at once (one
            # foreach copy) and scaled by ν with the others (one foreach product)
            writable = [la for la in held if la.name in self.writes.own]
            self._in_place.write_many(
                [la.adapter for la in writable], [results[la.name][0] for la in writable]
            )
            own = own + writable
            held = [la for la in held if la.name not in self.writes.own]
        if nu is not None and own:
            assert self._in_place is not None  # own layers are rescalable ones
            self._in_place.rescale([la.adapter for la in own], nu)
        for layer in held:
            value = results[layer.name][0]
            self.engine.write(layer.adapter, value if nu is None else value.mul_(nu))
        if self._model_parallel is not None:
            self._model_parallel.after_write()

    def _nu(
        self,
        dots: list[Tensor],
        layers: list[KFACLayer],
        clip: tuple[float | Tensor, float | Tensor] | None,
    ) -> Tensor | float | None:
        """The KL clip's scale from this rank's ``⟨V, ∇⟩`` terms (None: no clip).

        On CPU with the whole model on this rank the terms are read as
        numbers and ν is formed in Python: reading a CPU scalar costs nothing,
        where stacking, summing and the five scalar kernels of
        :func:`kl_scale` cost tens of microseconds a step (a tensor elsewhere:
        no host synchronisation on an accelerator)."""
        if clip is None:
            return None
        if dots and not self.comm.model_parallel and self.reads_free(dots[0].device):
            lr, bound = clip
            return kl_scale_value(math.fsum(float(d) for d in dots), float(lr), float(bound))
        inner = torch.stack(dots).sum() if dots else None
        if self.comm.model_parallel:
            # every rank of a model-parallel group joins, with 0 if it has no layer
            device = layers[0].adapter.device
            total = torch.zeros((), dtype=torch.float64, device=device)
            inner = self.comm.sum_model_parallel(total if inner is None else total.add_(inner))
        return None if inner is None else kl_scale(inner, *clip)

    def _shape_groups(self, layers: list[KFACLayer]) -> list[list[KFACLayer]]:
        """Layers preconditioned stacked (:mod:`kaisa.step.batched`): where
        every rank is every layer's worker and the engine hands whole
        gradients (no per-layer broadcast or gather to keep apart)."""
        if self.plan.grad_workers < self.plan.world_size or self._sharded is not None:
            return []
        return self.groups.split(layers)

    def _precondition_mine_stacked(
        self, layers: list[KFACLayer], damping: float
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """Where each layer has its own workers (f < 1, whole gradients): the
        layers this rank is a worker of, stacked by shape; each ``V`` is then
        broadcast to its receivers as a layer's own."""
        if self.plan.grad_workers == self.plan.world_size or self._sharded is not None:
            return {}
        mine = [la for la in layers if self.plan.layer(la.name).is_grad_worker(self.rank)]
        groups = self.groups.split(mine)
        return self._precondition_stacked(groups, damping) if groups else {}

    def _precondition_stacked(
        self, groups: list[list[KFACLayer]], damping: float
    ) -> dict[str, tuple[Tensor, Tensor]]:
        for group in groups:
            for layer in group:
                self.products.ready(layer, damping)
        own = self.writes.own if self._in_place is not None else frozenset()
        return self.groups.precondition(
            groups, self.engine, self._in_place, own, damping, self.profile
        )

    def _precondition(
        self, layers: list[KFACLayer], damping: float
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """``(V, ⟨V, ∇⟩)`` per layer, on every rank."""
        plans = [self.plan.layer(la.name) for la in layers]
        to_global = self.comm.global_ranks
        adapters = [la.adapter for la in layers]
        # this rank's stacked layers read their gradients stacked (kaisa.step.batched)
        results = self._precondition_mine_stacked(layers, damping)
        if self._sharded is not None:
            workers = [self._global_workers(lp, to_global) for lp in plans]
            grads = self._sharded.read_many(adapters, workers)
        else:
            grads = [None if la.name in results else self.engine.read(la.adapter) for la in layers]
        for layer, lp, grad in zip(layers, plans, grads):
            name = layer.name
            if lp.is_grad_worker(self.rank) and name not in results:
                assert grad is not None, f"engine gave no gradient to a worker of {name}"
                v = self.products.apply(layer, grad, damping)
                results[name] = (v, kl_term(v, grad))
            if self.plan.grad_workers < self.plan.world_size:
                # this rank's row of the rank grid: the same set for every
                # layer, with this layer's worker among them (O(1))
                group = self.plan.receiver_group_of(self.rank)
                src = lp.gradient_source(self.rank)
                if self.rank == src:
                    v, dot = results[name]
                    send = [v, dot.reshape(grad_message(v.shape)[1].shape)]
                else:
                    adapter = layer.adapter
                    dtype = grad.dtype if grad is not None else self._gradient_dtype(adapter)
                    matrix, dot_part = grad_message(adapter.matrix_shape)
                    buf = torch.empty(matrix.shape, dtype=dtype, device=adapter.device)
                    send = [buf, buf.new_empty(dot_part.shape)]

                def store(received: list[Tensor], name: str = name) -> None:
                    results[name] = (received[0], received[1].reshape(()))

                self.comm.broadcast(
                    send, src, group, None if self.rank == src else store, kind="grad_broadcast"
                )
        self.comm.wait()
        return results

    def _gradient_dtype(self, adapter: LayerAdapter) -> torch.dtype:
        """The dtype of a gradient this rank was not sent (receive buffers)."""
        if self._sharded is not None:
            return self._sharded.gradient_dtype(adapter)
        return adapter.weight.dtype

    def _global_workers(self, lp: LayerPlan, to_global: tuple[int, ...]) -> tuple[int, ...]:
        """A layer's workers as global ranks; layers share their worker tuple, so
        this is built once per worker group, not once per layer and step."""
        key = id(lp.grad_workers)
        found = self._globals.get(key)
        if found is None:
            found = self._globals[key] = tuple(to_global[r] for r in lp.grad_workers)
        return found
