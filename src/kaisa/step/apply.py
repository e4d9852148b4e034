"""Precondition → broadcast → scale → write back, along the write paths.

A step's layers (those taking part: :mod:`kaisa.step.participation`) go
down a chain of write paths, each taking the layers it can and leaving the
rest to the next (:class:`WritePath`):

1. **stacked** (:mod:`kaisa.step.batched`): layers of one shape at once,
   where every rank is every layer's worker and the engine hands whole
   gradients;
2. **in place** (:mod:`kaisa.step.in_place`): layers whose gradients the
   engine can rescale afterwards, each ``V`` written at once (the large
   ones' products in a reused workspace);
3. **per layer** (:mod:`kaisa.step.per_layer`): everything else, on its
   gradient workers, sent to the receivers under HYBRID-/MEM-OPT.

Each path returns every layer's ``V`` (None where already written) and its
``⟨V, ∇⟩``.  The KL clip's inner product is then summed over the
model-parallel groups (tensor and pipeline parallelism hold other layers of
the same model) before ``ν`` is formed, and the layers are written back:
the held ``V`` of a layer that owns its parameters in one multi-tensor copy,
every written layer scaled by ``ν`` in one multi-tensor product, the others
written ``ν·V`` through the engine.  The replayed path wraps this whole
application (:mod:`kaisa.step.execute`).
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
from torch import Tensor

from kaisa.core.kl_clip import kl_scale, kl_scale_value
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.plan import WorkPlan
from kaisa.engines.base import Engine, InPlaceGradients, ModelParallelLayers, ShardedReads
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.methods.capabilities import ColumnBlockApply, stacked_apply
from kaisa.step.batched import ShapeGroups, StackedPath
from kaisa.step.context import StepContext
from kaisa.step.diagnostics import StepDiagnostics
from kaisa.step.in_place import InPlaceWrites
from kaisa.step.participation import Participation
from kaisa.step.per_layer import PerLayerPath
from kaisa.step.products import LayerProducts, Result
from kaisa.step.profile import StepProfile

__all__ = ["GradientApplication", "WritePath"]


class WritePath(Protocol):
    """One way to precondition (and maybe write) a step's layers."""

    def take(
        self, layers: list[KFACLayer], damping: float
    ) -> tuple[dict[str, Result], list[KFACLayer]]:
        """``(V, ⟨V, ∇⟩)`` by name for the layers taken (``V`` None: written
        already, to be scaled by ``ν``), and the layers left, in order."""
        ...


class GradientApplication:
    """Writes ``ν·V`` into the gradients of the layers that have one."""

    def __init__(
        self, plan: WorkPlan, comm: Communicator, method: CurvatureMethod, engine: Engine
    ) -> None:
        self.plan = plan
        self.comm = comm
        self.method = method
        self.engine = engine
        # the engine's optional capabilities, asked once (None: it has not)
        self._in_place = engine if isinstance(engine, InPlaceGradients) else None
        sharded = isinstance(engine, ShardedReads)
        self._model_parallel = engine if isinstance(engine, ModelParallelLayers) else None
        #: one layer's V, as every write path computes it (kaisa.step.products)
        self.products = LayerProducts(plan, method, self._model_parallel)
        #: which layers take part in a step (kaisa.step.participation)
        self.participation = Participation(comm, engine)
        every = plan.grad_workers == plan.world_size
        #: layers written before ν, the workspace of the large ones (kaisa.step.in_place)
        # the method's capabilities, asked once (kaisa.methods.capabilities)
        blocks = method if isinstance(method, ColumnBlockApply) else None
        self.writes = InPlaceWrites(engine, self._in_place, self.products, blocks, every)
        #: layers of one shape preconditioned together (kaisa.step.batched)
        self.groups = ShapeGroups(stacked_apply(method))
        stacked = StackedPath(
            self.groups, engine, self.writes, self.products, every and not sharded
        )
        self.paths: tuple[WritePath, ...] = (
            stacked,
            self.writes,
            PerLayerPath(plan, comm, engine, self.products, stacked),
        )
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
        taking = self.participation.taking_part(layers, ctx.factor_step, ctx.presence)
        self.writes.workspace(layers)  # sized on the first step
        results: dict[str, Result] = {}
        rest = taking
        for path in self.paths:
            found, rest = path.take(rest, damping)
            results.update(found)
        counted = [results[la.name][1] for la in taking if self.products.counted(la)]
        nu = self._nu(counted, layers, ctx.clip)
        if self.diagnostics is not None:
            self.diagnostics.record_kl_scale(nu)
        self._write_back(taking, results, nu)

    def _write_back(
        self, layers: list[KFACLayer], results: dict[str, Result], nu: Tensor | float | None
    ) -> None:
        """Held ``V`` of the layers that own their parameters in one
        multi-tensor copy, then every written layer scaled by ``ν`` at once;
        the others written ``ν·V`` one by one."""
        written = [la for la in layers if results[la.name][0] is None]
        held = [la for la in layers if results[la.name][0] is not None]
        if self._in_place is not None:
            own = self.writes.own
            writable = [la for la in held if la.name in own]
            values = [cast(Tensor, results[la.name][0]) for la in writable]
            self._in_place.write_many([la.adapter for la in writable], values)
            written += writable
            held = [la for la in held if la.name not in own]
        if nu is not None and written:
            assert self._in_place is not None  # written layers are rescalable ones
            self._in_place.rescale([la.adapter for la in written], nu)
        for layer in held:
            value = cast(Tensor, results[layer.name][0])
            self.engine.write(layer.adapter, value if nu is None else value.mul_(nu))
        if self._model_parallel is not None:
            self._model_parallel.after_write()

    def _nu(
        self,
        dots: list[Tensor | None],
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
        terms = [d for d in dots if d is not None]
        if terms and not self.comm.model_parallel and self.reads_free(terms[0].device):
            lr, bound = clip
            return kl_scale_value(math.fsum(float(d) for d in terms), float(lr), float(bound))
        inner = torch.stack(terms).sum() if terms else None
        if self.comm.model_parallel:
            # every rank of a model-parallel group joins, with 0 if it has no layer
            device = layers[0].adapter.device
            total = torch.zeros((), dtype=torch.float64, device=device)
            inner = self.comm.sum_model_parallel(total if inner is None else total.add_(inner))
        return None if inner is None else kl_scale(inner, *clip)
