"""Tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``, or Megatron-core's ``ColumnParallelLinear`` /
``RowParallelLinear``): gradients and statistics of sharded linear layers.
Which layers are sharded, how and over which group is
:mod:`kaisa.engines.tensor_parallel.shards`'s answer; nothing here depends on the framework.

Each rank runs its own preconditioner over its data-parallel group
(``Topology(dp=mesh["dp"].get_group(), tp=mesh["tp"].get_group())``); the
ranks of a tensor-parallel group hold shards of the same layers and see the
same data.  Layers left unsharded are *replicated*: every
tensor-parallel rank preconditions them identically (no tp traffic) and only
tp rank 0 adds them to the KL clip, so each parameter is counted once.

``tensor_parallel='exact'``: each sharded layer's K-FAC work is done on ONE
tensor-parallel rank, its *primary* (assigned greedily by decomposition cost
so the work is divided, not duplicated).  Only the primary registers the
layer, with the unsharded sizes, so the primaries of a layer across
data-parallel replicas form exactly the data-parallel group that reduces,
decomposes and preconditions it.  A call's input shards (rowwise) or output
gradient shards (colwise) are gathered onto the primary in the hooks; at the
step, the gradient shards are gathered onto the primary where it is a
gradient worker, and the preconditioned matrix is scattered back, each rank
writing its own rows or columns.  The result equals the unsharded layer's.

``tensor_parallel='block'``: every rank preconditions its own shard with the
factor block of that shard (see :mod:`kaisa.layers.tensor_parallel`); no
tensor-parallel traffic but the KL clip's sum.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from kaisa.config import KFACConfig, TensorParallelMode
from kaisa.distributed import collectives
from kaisa.distributed.communicator import Communicator, group_ranks
from kaisa.distributed.topology import Topology
from kaisa.engines.base import EngineDefaults, ModelParallelLayers, ShardedReads
from kaisa.engines.pytorch import TorchEngine
from kaisa.engines.tensor_parallel.capture import ExactCapture
from kaisa.engines.tensor_parallel.group import TPGroup
from kaisa.engines.tensor_parallel.layout import ShardLayout
from kaisa.engines.tensor_parallel.shards import TPGroupOf, is_sharded, sharding_of
from kaisa.layers.base import LayerAdapter
from kaisa.layers.linear import LinearAdapter
from kaisa.layers.registry import SkippedModule
from kaisa.layers.state import KFACLayer
from kaisa.layers.tensor_parallel import (
    ExactShardedAdapter,
    ReplicatedBiasAdapter,
    ShardBlockAdapter,
    Sharding,
    Style,
    local,
)
from kaisa.step.capture.calls import Capture

__all__ = ["LocalGradAccess", "TensorParallelEngine", "assign_primaries"]


class LocalGradAccess:
    """``.grad`` read and written through a DTensor's local shard (plain tensors as is)."""

    def read(self, param: nn.Parameter) -> Tensor | None:
        return None if param.grad is None else local(param.grad)

    def write(self, param: nn.Parameter, value: Tensor) -> None:
        if param.grad is None:
            param.grad = value.detach().clone()
        else:
            local(param.grad).copy_(value)


def assign_primaries(costs: Sequence[float], size: int) -> list[int]:
    """A primary tensor-parallel rank per layer: greedy longest-processing-time
    (largest cost first, onto the least loaded rank, ties to the lower rank)."""
    load = [0.0] * size
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        out[i] = rank
        load[rank] += costs[i]
    return out


class TensorParallelEngine(TorchEngine, ShardedReads, ModelParallelLayers):
    """Gradients of a model whose linear layers are sharded over one
    tensor-parallel group (``tp``:
    :func:`~kaisa.engines.tensor_parallel.shards.tensor_parallel_group`).

    Its gradients are local shards read through :class:`LocalGradAccess`, so
    the in-place path it inherits is off (no layer is rescalable); it gathers
    an exact-mode layer's shards onto its primary (:class:`ShardedReads`)
    and divides the layers over the tensor-parallel ranks
    (:class:`ModelParallelLayers`)."""

    name = "tensor_parallel"

    def __init__(self, tp: TPGroupOf) -> None:
        super().__init__(LocalGradAccess())
        self.ranks = tp.ranks
        self.tp_rank = self.ranks.index(collectives.rank())
        self.tp_group = tp.group
        self.mode = TensorParallelMode.EXACT
        self.exact: list[ExactShardedAdapter] = []
        self.layouts: dict[str, ShardLayout] = {}
        self.group: TPGroup | None = None
        self._flags: list[int] = []
        self._pending: dict[str, Tensor] = {}
        self._default: Topology | None = None

    def defaults(self) -> EngineDefaults:
        """With no ``topology``, a mesh over the whole world is pure tensor
        parallelism: each rank is its own data-parallel group."""
        if self._default is None and len(self.ranks) == collectives.world_size():
            me = collectives.solo_group()
            self._default = Topology(dp=me, tp=self.tp_group)
        return EngineDefaults(topology=self._default)

    # -- construction ------------------------------------------------------------
    def select_layers(
        self, adapters: list[LayerAdapter], skipped: list[SkippedModule], config: KFACConfig
    ) -> list[LayerAdapter]:
        self.mode = config.tensor_parallel
        kept: list[LayerAdapter] = []
        sharded: list[tuple[LinearAdapter, Sharding]] = []
        for adapter in adapters:
            sharding = sharding_of(adapter)
            if sharding is not None:
                assert isinstance(adapter, LinearAdapter)
                sharded.append((adapter, sharding))
            elif not is_sharded(adapter):
                kept.append(adapter)
            else:
                kind = type(adapter.module).__name__
                why = f"sharded {kind}: kaisa's tensor parallelism supports linear layers only"
                params = tuple(adapter.param_names())
                skipped.append(SkippedModule(adapter.name, kind, why, params, changed=True))
        if self.mode is TensorParallelMode.BLOCK:
            for adapter, sharding in sharded:
                kept.append(ShardBlockAdapter(adapter, sharding, len(self.ranks), self.tp_rank))
                if sharding.style is Style.ROWWISE and adapter.has_bias:
                    kept.append(ReplicatedBiasAdapter(adapter, sharding))
            return kept
        full = [ExactShardedAdapter(a, sharding, primary=0) for a, sharding in sharded]
        costs = [float(a.a_dim**3 + a.g_dim**3) for a in full]
        for exact, primary in zip(full, assign_primaries(costs, len(self.ranks))):
            exact.primary = primary
            self.exact.append(exact)
            self.layouts[exact.name] = ShardLayout(exact, len(self.ranks))
        if not kept and len(self.exact) < len(self.ranks):
            raise ValueError(
                f"tensor_parallel='exact' gives each of the {len(self.ranks)} tensor-parallel "
                f"ranks at least one layer, but the model has {len(self.exact)} sharded layer(s) "
                "and no replicated one: use tensor_parallel='block'"
            )
        return kept + [a for a in self.exact if a.primary == self.tp_rank]

    def connect(self, comm: Communicator, capture: Capture, layers: list[KFACLayer]) -> None:
        tp = comm.topology.tp
        if tp is None or tuple(group_ranks(tp)) != self.ranks:
            raise ValueError(
                "topology.tp must be the tensor-parallel group of the sharded layers "
                f"(ranks {list(self.ranks)}): pass kaisa.Topology(dp=mesh['dp'].get_group(), "
                "tp=mesh['tp'].get_group()), or with Megatron-core "
                "Topology(dp=parallel_state.get_data_parallel_group(), "
                "tp=parallel_state.get_tensor_model_parallel_group())"
            )
        if set(comm.global_ranks) & set(self.ranks) != {collectives.rank()}:
            raise ValueError("topology.dp and topology.tp must meet in this rank only")
        self.group = TPGroup(self.ranks, comm.stats, comm.timeout_s)
        if self.exact:
            by_name = {la.name: la for la in layers}
            hooks = ExactCapture(capture, self.group, by_name)
            capture.adopt(hooks.install(self.exact))

    # -- the step ------------------------------------------------------------------
    def counts_in_kl(self, adapter: LayerAdapter) -> bool:
        sharded = isinstance(adapter, ExactShardedAdapter | ShardBlockAdapter)
        return sharded or self.tp_rank == 0

    def read_many(
        self, adapters: Sequence[LayerAdapter], workers: Sequence[Sequence[int]]
    ) -> list[Tensor | None]:
        out = [None if isinstance(a, ExactShardedAdapter) else self.read(a) for a in adapters]
        if not self.exact:
            return out
        assert self.group is not None
        index = {a.name: i for i, a in enumerate(adapters)}
        me = collectives.rank()
        flags = torch.zeros(len(self.exact), dtype=torch.int32, device=self.exact[0].device)
        for j, a in enumerate(self.exact):
            if a.name in index:  # this rank is the primary and the layer takes part
                flags[j] = 2 if me in workers[index[a.name]] else 1
        self._flags = [int(f) for f in self.group.sum(flags).tolist()]
        for name, matrix in self._gather_gradients().items():
            out[index[name]] = matrix
        return out

    def gradient_dtype(self, adapter: LayerAdapter) -> torch.dtype:
        return adapter.weight.dtype

    def _gather_gradients(self) -> dict[str, Tensor]:
        """Full gradients of the layers whose primary is a gradient worker, on
        that primary: one gather per primary rank."""
        assert self.group is not None
        full: dict[str, Tensor] = {}
        for primary in range(len(self.ranks)):
            mine = self._layers_of(primary, needs_gradient=True)
            if not mine:
                continue
            flat = torch.cat([self.layouts[a.name].grad_piece() for a in mine])
            parts = self.group.gather(flat, primary, "tp_grad_gather")
            if parts is None:
                continue
            at = 0
            for a in mine:
                layout = self.layouts[a.name]
                n = layout.grad_piece_numel
                full[a.name] = layout.assemble(parts[:, at : at + n])
                at += n
        return full

    def _layers_of(self, primary: int, needs_gradient: bool) -> list[ExactShardedAdapter]:
        wanted = 2 if needs_gradient else 1
        return [
            a for a, flag in zip(self.exact, self._flags) if a.primary == primary and flag >= wanted
        ]

    def write(self, adapter: LayerAdapter, matrix: Tensor) -> None:
        if isinstance(adapter, ExactShardedAdapter):
            self._pending[adapter.name] = matrix  # scattered in after_write
            return
        super().write(adapter, matrix)

    def after_write(self) -> None:
        """Scatter each primary's preconditioned matrices to the shards: one
        ``scatter`` per primary rank."""
        if not self.exact:
            return
        assert self.group is not None
        for primary in range(len(self.ranks)):
            mine = self._layers_of(primary, needs_gradient=False)
            if not mine:
                continue
            layouts = [self.layouts[a.name] for a in mine]
            pieces = None
            if self.group.rank == primary:
                split = [lo.split(self._pending.pop(lo.adapter.name)) for lo in layouts]
                pieces = [torch.cat([s[t] for s in split]) for t in range(len(self.ranks))]
            like = _like(mine[0], sum(lo.out_piece_numel for lo in layouts))
            received = self.group.scatter(pieces, like, primary)
            at = 0
            for lo in layouts:
                lo.write(received[at : at + lo.out_piece_numel], self.group.rank)
                at += lo.out_piece_numel
        self._pending.clear()


def _like(adapter: LayerAdapter, numel: int) -> Tensor:
    weight = local(adapter.weight.grad)
    return weight.new_empty(numel)
