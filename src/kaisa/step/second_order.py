"""Decompose → broadcast → complete: the second-order update of the KAISA plan.

Each factor's owner decomposes it with the curvature method and sends the
result to the layer's gradient workers (under COMM-OPT: every rank); the
workers complete what they received (e.g., the eigenvalue outer product),
and ranks that are not workers of a layer drop its tensors.  What travels is
read from the method's declaration, never named here.

A failed decomposition keeps the previous tensors; an owner that never
succeeded sends a damping-only stand-in, so every rank stays in the same
collectives and the layer is still (safely) preconditioned.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from kaisa.core.decompose import DecompositionError
from kaisa.core.specs import FactorKind
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.plan import WorkPlan
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod, HeldTensor, Transfer
from kaisa.step.profile import DECOMPOSE, StepProfile

__all__ = ["SecondOrderUpdate"]

logger = logging.getLogger("kaisa")


class SecondOrderUpdate:
    """Runs the second-order update of a set of layers on every rank."""

    def __init__(self, plan: WorkPlan, comm: Communicator, method: CurvatureMethod) -> None:
        self.plan = plan
        self.comm = comm
        self.method = method
        self.rank = comm.rank
        #: told what is decomposed while a profile is attached (:mod:`kaisa.step.profile`)
        self.profile: StepProfile | None = None
        #: every layer's tensors must be recomputed at the next step (after a load)
        self.stale = False
        #: every captured layer is decomposed (as of the last look; a fold, an
        #: inverse step or a load looks again)
        self.settled = False

    def update(self, layers: list[KFACLayer], inverse_step: bool, damping: float) -> None:
        """Decompose and broadcast every captured layer on an inverse step or
        after a load (:attr:`stale`); otherwise only a layer captured for the
        first time since the last look (:attr:`settled`), at once."""
        every = self.stale or inverse_step
        if every or not self.settled:
            due = [la for la in layers if la.captured and (every or not la.decomposed)]
            self.run(due, damping)
            self.settled = all(la.decomposed for la in layers if la.captured)
        self.stale = False

    def run(self, layers: list[KFACLayer], damping: float) -> None:
        """Update ``layers`` (the same list, in the same order, on every rank)."""
        if not layers:
            return
        exchanged = self._exchange(layers)
        for layer in layers:
            lp = self.plan.layer(layer.name)
            for transfer in self.method.transfers(layer.factors, lp.colocated):
                owner = lp.owners[transfer.factors[0]]
                if self.rank == owner:
                    self._decompose(layer, transfer, damping, exchanged.get(layer.name))
                if self.rank in lp.grad_workers:
                    self._broadcast(layer, transfer, owner, lp.grad_workers)
        self.comm.wait()
        for layer in layers:
            lp = self.plan.layer(layer.name)
            layer.decomposed = True
            if self.rank in lp.grad_workers:
                self.method.complete(layer, damping, lp.colocated)
            else:
                layer.state.clear()

    def _exchange(self, layers: list[KFACLayer]) -> dict[str, Tensor]:
        """The method's per-layer vectors, summed over the group when factors are split."""
        vectors = {la.name: self.method.exchange(la) for la in layers}
        present = {n: v for n, v in vectors.items() if v is not None}
        if not present or not self.comm.distributed or self.plan.colocate_factors:
            return present
        names = list(present)
        flat = torch.cat([present[n] for n in names])
        result: list[Tensor] = []
        self.comm.allreduce_sum(flat, result.extend)
        self.comm.wait()
        out, offset = {}, 0
        for name in names:
            size = present[name].numel()
            out[name] = result[0][offset : offset + size]
            offset += size
        return out

    def _decompose(
        self, layer: KFACLayer, transfer: Transfer, damping: float, exchanged: Tensor | None
    ) -> None:
        layer.decompositions += len(transfer.factors)
        new: dict[str, Tensor] = {}
        if any(layer.running[i] is None for i in transfer.factors):
            # every batch so far was non-finite: nothing to decompose yet
            self._fill_missing(layer, transfer.tensors, damping)
            return
        if self.profile is not None:
            for i in transfer.factors:
                spec = layer.factors[i]
                if spec.kind is FactorKind.DENSE:
                    self.profile.record(DECOMPOSE, self.method.kernel, (spec.dim, spec.dim))
        try:
            new = self.method.decompose(
                layer, transfer.factors, damping, layer.inv_dtype, exchanged
            )
        except DecompositionError as exc:
            layer.failed_decompositions += 1
            logger.warning(
                "decomposition of %s failed (%s); keeping the previous one", layer.name, exc
            )
        # row-major, as a broadcast delivers them to the other workers: LAPACK
        # returns column-major results, and a product with another layout rounds
        # differently, so the layer's workers (and a resumed run, whose tensors
        # come from a checkpoint) would differ in the last bits
        new = {key: value.contiguous() for key, value in new.items()}
        self.method.receive(layer, new)
        self._fill_missing(layer, transfer.tensors, damping)

    def _fill_missing(
        self, layer: KFACLayer, tensors: tuple[HeldTensor, ...], damping: float
    ) -> None:
        like = torch.empty(0, dtype=layer.inv_dtype, device=layer.adapter.device)
        self.method.fill_missing(layer, tensors, damping, like)

    def _broadcast(
        self, layer: KFACLayer, transfer: Transfer, owner: int, workers: tuple[int, ...]
    ) -> None:
        if self.rank == owner:
            tensors = [layer.state[t.key] for t in transfer.tensors]
        else:
            tensors = [
                torch.empty(t.shape, dtype=layer.inv_dtype, device=layer.adapter.device)
                for t in transfer.tensors
            ]
        keys = [t.key for t in transfer.tensors]

        def store(received: list[Tensor]) -> None:
            # each its own allocation, as on the decomposer and after a checkpoint's
            # load: a view into the bucket may sit unaligned, and a product over
            # unaligned memory can round differently
            owned = [t.clone() if t.storage_offset() else t for t in received]
            self.method.receive(layer, dict(zip(keys, owned)))

        self.comm.broadcast(
            tensors,
            owner,
            workers,
            None if self.rank == owner else store,
            symmetric=[t.symmetric for t in transfer.tensors],
            kind="second_order_broadcast",
        )
