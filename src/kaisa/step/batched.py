"""Layers of one shape preconditioned together: one batched product per group.

On an accelerator a K-FAC step is a stream of small kernel launches: per
layer a gradient read, four products, a division, an inner product for the
KL clip and a write.  A Transformer's blocks repeat the same shapes, so the
layers of each shape are stacked and preconditioned by one batched product
per factor (``[L, g, g] @ [L, g, a] @ [L, a, a]``) and one inner product
for the whole group: the products launched per step grow with the number
of distinct shapes, not with the number of layers.

The method's own :meth:`~kaisa.methods.base.CurvatureMethod.apply` runs on
the stacks (its products go through :func:`kaisa.core.kronecker.mul_axis`,
which treats a stack of matrices as a batch), so a stacked group equals its
layers one by one to rounding.  A method opts in by implementing
:class:`~kaisa.methods.capabilities.StackedApply`; a group is
formed from the layers a rank is a gradient worker of (all of them under
COMM-OPT; under HYBRID-OPT and MEM-OPT each ``V`` is then broadcast to its
receivers as a layer's own), where the engine hands whole gradients (not
FSDP2's rows), from layers whose factors are all dense and whose operands
are small (:data:`MAX_OPERAND_NUMEL`): stacking copies
the operands once per inverse update, which costs memory, and large layers
are bound by their products, not by launches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from kaisa.core.specs import FactorKind
from kaisa.core.workspace import MAX_OPERAND_NUMEL
from kaisa.engines.base import Engine, InPlaceGradients
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import Operands
from kaisa.methods.capabilities import StackedApply
from kaisa.step.in_place import InPlaceWrites
from kaisa.step.products import LayerProducts, Result
from kaisa.step.profile import PRODUCTS, StepProfile, factor_sizes

__all__ = ["ShapeGroups", "StackedPath", "read_stacked"]

#: ``(method, operands, stacked, damping) -> (V, ⟨V, ∇⟩ per layer)``
Kernel = Callable[..., tuple[Tensor, Tensor]]


GroupKey = tuple[object, ...]


class _Stack:
    """One group's operands stacked, and what they were stacked from (the
    tensors themselves, not their ids, which a new tensor may reuse)."""

    def __init__(self) -> None:
        self.sources: list[tuple[Tensor, int]] = []
        self.state: dict[str, Tensor] = {}

    def current(self, tensors: list[Tensor]) -> bool:
        return len(tensors) == len(self.sources) and all(
            t is s and t._version == v for t, (s, v) in zip(tensors, self.sources, strict=True)
        )


class ShapeGroups:
    """Finds the groups of a step's layers and preconditions each at once.

    Args:
        method: the curvature method where it can precondition stacked
            layers (None: nothing is grouped).
    """

    def __init__(self, method: StackedApply | None) -> None:
        self.method = method
        self._stacks: dict[tuple[str, ...], _Stack] = {}
        self._kernel: Kernel = group_kernel
        self._cuda_graphs = False
        self._allowed = True
        #: moves when :attr:`allowed` changes (what a recording of the step reads)
        self.revision = 0

    def compile(self, **options: Any) -> None:
        """Run each group's kernel compiled (``torch.compile(**options)``,
        whole graph).  The first group shape compiles a graph of its own, the
        second one with dynamic shapes that serves every shape after it: a
        graph per shape would reach dynamo's recompile limit (8) on a model
        of many shapes (a ResNet), where ``fullgraph`` makes that an error.
        The damping is a graph input (a schedule does not recompile).  With CUDA graphs
        (``mode='reduce-overhead'``) each step starts a new generation of
        them (``torch.compiler.cudagraph_mark_step_begin``): the previous
        step's outputs have been written back by then."""
        options = {"fullgraph": True, **options}
        self._kernel = torch.compile(group_kernel, **options)
        self._cuda_graphs = options.get("mode") in ("reduce-overhead", "max-autotune")

    @property
    def allowed(self) -> bool:
        """False: every layer on its own (``precond.stacking``)."""
        return self._allowed

    @allowed.setter
    def allowed(self, value: bool) -> None:
        if value != self._allowed:
            self._allowed = value
            self.revision += 1

    @property
    def enabled(self) -> bool:
        return self.allowed and self.method is not None

    def split(self, layers: Sequence[KFACLayer]) -> list[list[KFACLayer]]:
        """The groups (two layers or more) among ``layers``, in their order."""
        if not self.enabled:
            return []
        by_key: dict[GroupKey, list[KFACLayer]] = {}
        for layer in layers:
            key = self._key(layer)
            if key is not None:
                by_key.setdefault(key, []).append(layer)
        return [group for group in by_key.values() if len(group) > 1]

    @staticmethod
    def _key(layer: KFACLayer) -> GroupKey | None:
        """What layers must share to be stacked (None: this one never is)."""
        if any(spec.kind is not FactorKind.DENSE for spec in layer.factors):
            return None
        state = layer.operands()
        if not state or any(t.numel() > MAX_OPERAND_NUMEL for t in state.values()):
            return None
        adapter = layer.adapter
        return (
            tuple((spec.dim, spec.axis) for spec in layer.factors),
            # by name: the order a layer's operands arrived in (which owner
            # sent first, colocate_factors=False) is not what it holds
            tuple(sorted((key, tuple(t.shape), str(t.dtype)) for key, t in state.items())),
            tuple(adapter.matrix_shape),
            adapter.weight.dtype,
            adapter.device,
        )

    def apply(
        self, group: list[KFACLayer], stacked: Tensor, damping: float
    ) -> list[tuple[Tensor, Tensor]]:
        """``(V, ⟨V, ∇⟩)`` of each layer of ``group`` from their gradients
        stacked ``[L, ...]``: one stacked apply, one inner product (each ``V``
        and term a view of the group's result)."""
        assert self.method is not None, "split() forms no group for a method that cannot stack"
        operands = Operands(group[0].factors, self._operands(group))
        v, dots = self._kernel(self.method, operands, stacked, damping)
        return list(zip(v.unbind(0), dots.unbind(0), strict=True))

    def precondition(
        self,
        groups: list[list[KFACLayer]],
        engine: Engine,
        in_place: InPlaceGradients | None,
        own: frozenset[str],
        damping: float,
        profile: StepProfile | None = None,
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """``(V, ⟨V, ∇⟩)`` by layer name for every group (their operands
        ready); ``profile``: each group's products and inner product are timed."""
        results: dict[str, tuple[Tensor, Tensor]] = {}
        if self._cuda_graphs and groups:
            torch.compiler.cudagraph_mark_step_begin()
        for group in groups:
            stacked = read_stacked(
                group, engine, in_place if all(la.name in own for la in group) else None
            )
            since = profile.start() if profile is not None else 0.0
            found = self.apply(group, stacked, damping)
            if profile is not None:
                profile.stop(PRODUCTS, since)
                profile.record(PRODUCTS, "products", stacked.shape, factor_sizes(group[0].factors))
            for layer, result in zip(group, found, strict=True):
                results[layer.name] = result
        return results

    def _operands(self, group: list[KFACLayer]) -> dict[str, Tensor]:
        """The group's operands stacked, restacked only when a layer's
        changed (a new decomposition: new tensors, or written in place)."""
        states = [layer.operands() for layer in group]
        tensors = [t for state in states for t in state.values()]
        names = tuple(layer.name for layer in group)
        stack = self._stacks.get(names)
        if stack is None:
            stack = self._stacks[names] = _Stack()
        if not stack.current(tensors):
            stack.state = {key: torch.stack([s[key] for s in states]) for key in states[0]}
            stack.sources = [(t, t._version) for t in tensors]
        return stack.state

    def nbytes(self) -> int:
        """Memory held by the stacked operands."""
        return sum(
            t.numel() * t.element_size() for s in self._stacks.values() for t in s.state.values()
        )


class StackedPath:
    """The stacked write path (:class:`~kaisa.step.apply.WritePath`): the
    groups of a step's layers, each preconditioned at once.

    Args:
        groups: finds the groups and runs their products.
        engine: where the gradients are read.
        writes: the in-place path (which layers own their gradients: read
            as the parameters' own blocks, stacked at once).
        products: one layer's stand-ins, and the profile.
        every_worker: every rank is every layer's worker and the engine hands
            whole gradients (else the path takes nothing; the per-layer path
            stacks a rank's own layers through :meth:`groups_of`).
    """

    def __init__(
        self,
        groups: ShapeGroups,
        engine: Engine,
        writes: InPlaceWrites,
        products: LayerProducts,
        every_worker: bool,
    ) -> None:
        self.groups = groups
        self.engine = engine
        self.writes = writes
        self.products = products
        self.every_worker = every_worker

    def take(
        self, layers: list[KFACLayer], damping: float
    ) -> tuple[dict[str, Result], list[KFACLayer]]:
        if not self.every_worker:
            return {}, layers
        results = self.groups_of(layers, damping)
        return results, [la for la in layers if la.name not in results]

    def groups_of(self, layers: list[KFACLayer], damping: float) -> dict[str, Result]:
        """``(V, ⟨V, ∇⟩)`` of the layers among ``layers`` that stack (two or more of a shape)."""
        groups = self.groups.split(layers)
        if not groups:
            return {}
        for group in groups:
            for layer in group:
                self.products.ready(layer, damping)
        in_place = self.writes.in_place
        own = self.writes.own if in_place is not None else frozenset()
        found = self.groups.precondition(
            groups, self.engine, in_place, own, damping, self.products.profile
        )
        return dict(found)


def group_kernel(
    method: StackedApply, operands: Operands, stacked: Tensor, damping: float
) -> tuple[Tensor, Tensor]:
    """``V`` of a stacked group ``[L, ...]`` (the method's stacked apply)
    and each layer's ``⟨V, ∇⟩`` (one inner product for the group)."""
    v = method.apply_stacked(operands, stacked, damping)
    layers = stacked.shape[0]
    dots = torch.linalg.vecdot(v.reshape(layers, -1), stacked.reshape(layers, -1).to(v.dtype))
    return v, dots


def read_stacked(
    group: list[KFACLayer], engine: Engine, in_place: InPlaceGradients | None
) -> Tensor:
    """The group's gradient matrices stacked ``[L, g, a]``: where they are the
    layers' own ``.grad`` (``in_place``, for layers that own their
    parameters: :meth:`InPlaceGradients.grad_blocks`), the weights' and the
    biases' each stacked at once and joined (three copies per group, not one
    per layer); else read layer by layer."""
    if in_place is not None:
        found = [in_place.grad_blocks(la.adapter) for la in group]
        blocks = [b for b in found if b is not None]
        if len(blocks) == len(group) and len({len(b) for b in blocks}) == 1:
            parts = [torch.stack([b[j] for b in blocks]) for j in range(len(blocks[0]))]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    grads = []
    for layer in group:
        grad = engine.read(layer.adapter)
        assert grad is not None, f"engine gave no gradient to a worker of {layer.name}"
        grads.append(grad)
    return torch.stack(grads)
