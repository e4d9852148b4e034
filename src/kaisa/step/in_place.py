"""Layers preconditioned and written back one at a time, before ``ν`` is known.

Where every rank is every layer's worker, a layer whose gradient the engine
can rescale afterwards (:meth:`~kaisa.engines.base.InPlaceGradients.rescalable`)
need not be held until the KL clip's ``ν`` is formed: its ``V`` is written at
once and the whole set is scaled by ``ν`` in one multi-tensor product.  The
large ones (:func:`~kaisa.core.workspace.uses_workspace`) compute in a reused
workspace, reading and writing their own gradients where the method can —
the memory of the step stays that of one layer, not of every ``V``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.core.kl_clip import kl_term, sum_kl_terms
from kaisa.core.workspace import Workspace, uses_workspace
from kaisa.engines.base import Engine, InPlaceGradients
from kaisa.layers.state import KFACLayer
from kaisa.methods.capabilities import ColumnBlockApply
from kaisa.step.products import LayerProducts, Result
from kaisa.step.profile import PRODUCTS, StepProfile, factor_sizes

__all__ = ["InPlaceWrites"]


class InPlaceWrites:
    """Which layers are written before ``ν`` (:attr:`own`), the workspace of
    the large ones, and the writing.

    Args:
        engine: the step's engine (``in_place``: the same, where it offers
            :class:`InPlaceGradients`; None disables this path).
        products: one layer's ``V`` (shared with the other write paths).
        blocks: the curvature method where it reads and writes column blocks
            (None: every ``V`` is formed by ``apply`` and then written).
        every_worker: every rank is every layer's worker (else the path takes nothing).
    """

    def __init__(
        self,
        engine: Engine,
        in_place: InPlaceGradients | None,
        products: LayerProducts,
        blocks: ColumnBlockApply | None,
        every_worker: bool,
    ) -> None:
        self.every_worker = every_worker
        self.blocks = blocks
        self.engine = engine
        self.in_place = in_place
        self.products = products
        self._work: Workspace | None = None
        self._sized = False
        self._served: frozenset[str] = frozenset()  # layers whose products use it
        #: layers written before ν (rescalable)
        self.own: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        """Bytes held by the reused product buffers (:mod:`kaisa.core.workspace`)."""
        return 0 if self._work is None else self._work.nbytes()

    def workspace(self, layers: list[KFACLayer]) -> Workspace | None:
        """The workspace of the layers it serves, built on the first step:
        large layers whose gradients may be written before ``ν`` is known
        (none where the engine does not offer the in-place path)."""
        if self._work is None and not self._sized:
            self._sized = True
            if self.in_place is None:
                return None
            allowed = self.in_place.rescalable([la.adapter for la in layers])
            self.own = frozenset(la.name for la, ok in zip(layers, allowed) if ok)
            shapes = {}
            for la in layers:
                shape = la.adapter.matrix_shape
                numel = int(torch.Size(shape).numel())
                size = la.adapter.weight.element_size()
                if la.name in self.own and uses_workspace(la.adapter.device, numel, size):
                    shapes[la.name] = shape
            self._served = frozenset(shapes)
            if shapes:
                self._work = Workspace.for_shapes(list(shapes.values()), layers[0].adapter.device)
        return self._work

    def take(
        self, layers: list[KFACLayer], damping: float
    ) -> tuple[dict[str, Result], list[KFACLayer]]:
        """The in-place write path (:class:`~kaisa.step.apply.WritePath`):
        the layers that own their parameters, each written at once."""
        work = self._work
        if work is None or not self.every_worker:
            return {}, layers
        own = [la for la in layers if la.name in self.own]
        if not own:
            return {}, layers
        dots = self.write_each(own, work, damping, self.products.profile)
        taken: dict[str, Result] = {la.name: (None, dots.get(la.name)) for la in own}
        return taken, [la for la in layers if la.name not in self.own]

    def write_each(
        self,
        layers: list[KFACLayer],
        work: Workspace,
        damping: float,
        profile: StepProfile | None = None,
    ) -> dict[str, Tensor]:
        """Precondition and write back one layer after the other; the
        products of the layers the workspace serves reuse it, and read and
        write those layers' own gradients where the method can
        (:meth:`_write_in_place`).  Returns the counted layers' ``⟨V, ∇⟩`` by
        name.  ``profile``: the in-place products are timed."""
        engine = self.in_place
        assert engine is not None  # only rescalable layers are written one by one
        dots = {}
        for layer in layers:
            counted = self.products.counted(layer)
            lw = work if layer.name in self._served else None
            if lw is not None:
                done, dot = self._write_in_place(layer, lw, damping, counted, profile)
                if done:
                    if dot is not None:
                        dots[layer.name] = dot
                    continue
            adapter = layer.adapter
            grad = engine.read_into(adapter, lw) if lw is not None else self.engine.read(adapter)
            assert grad is not None, f"engine gave no gradient to a worker of {layer.name}"
            v = self.products.apply(layer, grad, damping, lw)
            if counted:
                dots[layer.name] = kl_term(v, grad)
            self.engine.write(layer.adapter, v)
        return dots

    def _write_in_place(
        self,
        layer: KFACLayer,
        work: Workspace,
        damping: float,
        counted: bool,
        profile: StepProfile | None = None,
    ) -> tuple[bool, Tensor | None]:
        """``V`` computed from the layer's own gradients and written over
        them: the first product reads ``∇W`` and ``∇b`` where they lie and
        the last writes into them, so no ``[∇W | ∇b]`` is assembled and no
        ``V`` copied (four gradient-sized passes fewer; the eigen method also
        forms ``⟨V, ∇⟩`` in its eigenbasis, so ``∇`` is not kept either).
        Returns (done, the counted ``⟨V, ∇⟩``); not done where the engine or
        the method cannot (the caller then takes the general path)."""
        assert self.in_place is not None
        method = self.blocks
        blocks = self.in_place.grad_blocks(layer.adapter)
        if method is None or blocks is None:
            return False, None
        self.products.ready(layer, damping)
        operands = self.products.operands(layer)
        if not method.writes_blocks(operands, blocks[0].dtype):
            return False, None
        work.prepare(blocks[0].dtype, blocks[0].dtype)  # the memory held: all three, always
        kept = work.keep(blocks) if counted and not method.forms_kl_term else None
        since = profile.start() if profile is not None else 0.0
        dot = method.apply_blocks(operands, blocks, damping, work, blocks, counted)
        if profile is not None:
            profile.stop(PRODUCTS, since)
            shape = (blocks[0].shape[0], sum(int(b.shape[1]) for b in blocks))
            profile.record(PRODUCTS, "products", shape, factor_sizes(layer.factors))
        if kept is not None:
            dot = sum_kl_terms(blocks, kept)
        return True, dot
