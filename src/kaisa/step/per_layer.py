"""The general write path: each layer preconditioned on its gradient workers
and, when there are fewer workers than ranks (HYBRID-/MEM-OPT), sent to its
receivers.

Only a layer's gradient workers need its full gradient: the engine reads
all layers in one agreed order and may gather each onto its workers only
(DeepSpeed ZeRO keeps gradients partitioned).  So the KL clip's per-layer
term ``⟨V, ∇⟩`` is formed where ``V`` is, and travels with ``V`` to the
receivers (:func:`~kaisa.distributed.messages.grad_message`), exactly as
every rank would have computed it.  Where the engine hands whole gradients,
the layers this rank is a worker of are stacked by shape
(:mod:`kaisa.step.batched`) before each ``V`` is sent as a layer's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.core.kl_clip import kl_term
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.messages import grad_message
from kaisa.distributed.plan import LayerPlan, WorkPlan
from kaisa.engines.base import Engine, ShardedReads
from kaisa.layers.base import LayerAdapter
from kaisa.layers.state import KFACLayer
from kaisa.step.batched import StackedPath
from kaisa.step.products import LayerProducts, Result

__all__ = ["PerLayerPath"]


class PerLayerPath:
    """Takes every layer it is handed (the last path)."""

    def __init__(
        self,
        plan: WorkPlan,
        comm: Communicator,
        engine: Engine,
        products: LayerProducts,
        stacked: StackedPath,
    ) -> None:
        self.plan = plan
        self.comm = comm
        self.engine = engine
        self.products = products
        self.stacked = stacked
        self.rank = comm.rank
        self._sharded = engine if isinstance(engine, ShardedReads) else None
        self._globals: dict[int, tuple[int, ...]] = {}

    def take(
        self, layers: list[KFACLayer], damping: float
    ) -> tuple[dict[str, Result], list[KFACLayer]]:
        """``(V, ⟨V, ∇⟩)`` per layer, on every rank; leaves nothing."""
        if not layers:
            return {}, []
        plans = [self.plan.layer(la.name) for la in layers]
        adapters = [la.adapter for la in layers]
        results: dict[str, Result] = {}
        if self.plan.grad_workers < self.plan.world_size and self._sharded is None:
            # this rank's layers stacked by shape; each V then sent as a layer's own
            mine = [la for la, lp in zip(layers, plans) if lp.is_grad_worker(self.rank)]
            results.update(self.stacked.groups_of(mine, damping))
        if self._sharded is not None:
            to_global = self.comm.global_ranks
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
                self._send(layer, lp, grad, results)
        self.comm.wait()
        return results, []

    def _send(
        self, layer: KFACLayer, lp: LayerPlan, grad: Tensor | None, results: dict[str, Result]
    ) -> None:
        """``V`` and ``⟨V, ∇⟩`` from the layer's worker in this rank's row of
        the rank grid (the same set for every layer: O(1)) to the others."""
        name = layer.name
        group = self.plan.receiver_group_of(self.rank)
        src = lp.gradient_source(self.rank)
        if self.rank == src:
            v, dot = results[name]
            assert v is not None and dot is not None
            send = [v, dot.reshape(grad_message(v.shape)[1].shape)]
        else:
            adapter = layer.adapter
            dtype = grad.dtype if grad is not None else self._gradient_dtype(adapter)
            matrix, dot_part = grad_message(adapter.matrix_shape)
            buf = torch.empty(matrix.shape, dtype=dtype, device=adapter.device)
            send = [buf, buf.new_empty(dot_part.shape)]

        def store(received: list[Tensor]) -> None:
            results[name] = (received[0], received[1].reshape(()))

        self.comm.broadcast(
            send, src, group, None if self.rank == src else store, kind="grad_broadcast"
        )

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
