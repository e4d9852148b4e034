"""Tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``): gradients and statistics of sharded Linear layers.

Each rank runs its own preconditioner over its data-parallel group
(``Topology(dp=mesh["dp"].get_group(), tp=mesh["tp"].get_group())``); the
ranks of a tensor-parallel group hold shards of the same layers and see the
same data.  Layers parallelize_module left alone are *replicated*: every
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

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kaisa.capture import Capture, _first_tensor, _Hook
from kaisa.comm import Communicator, group_ranks
from kaisa.config import KFACConfig, TensorParallelMode
from kaisa.engines.base import EngineDefaults
from kaisa.engines.pytorch import TorchEngine
from kaisa.engines.tp_group import TPGroup
from kaisa.engines.tp_layout import ShardLayout
from kaisa.layer import KFACLayer
from kaisa.layers.base import LayerAdapter
from kaisa.layers.linear import LinearAdapter
from kaisa.layers.registry import SkippedModule
from kaisa.layers.tensor_parallel import (
    ExactShardedAdapter,
    ReplicatedBiasAdapter,
    ShardBlockAdapter,
    Style,
    local,
)
from kaisa.topology import Topology

__all__ = ["LocalGradAccess", "TensorParallelEngine", "assign_primaries", "tensor_parallel_mesh"]


def _style(param: Any) -> Style | None:
    """The sharding of a DTensor weight on a one-dimensional mesh, if any."""
    placements = getattr(param, "placements", None)
    if not placements or not any(p.is_shard() for p in placements):
        return None
    if tuple(placements) == (_shard(0),):
        return Style.COLWISE
    if tuple(placements) == (_shard(1),):
        return Style.ROWWISE
    raise NotImplementedError(
        f"kaisa: a weight placed {tuple(placements)} is not supported; tensor parallelism "
        "supports ColwiseParallel (Shard(0)) and RowwiseParallel (Shard(1)) on a 1-D mesh"
    )


def _shard(dim: int) -> Any:
    from torch.distributed.tensor import Shard

    return Shard(dim)


def tensor_parallel_mesh(model: nn.Module) -> Any:
    """The device mesh of the model's sharded DTensor parameters (None if none)."""
    meshes = {}
    for param in model.parameters():
        placements = getattr(param, "placements", None)
        if placements and any(p.is_shard() for p in placements):
            mesh = getattr(param, "device_mesh", None)
            meshes[id(mesh)] = mesh
    if len(meshes) > 1:
        raise NotImplementedError("kaisa: sharded parameters on more than one device mesh")
    return next(iter(meshes.values()), None)


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


class TensorParallelEngine(TorchEngine):
    """Gradients of a model parallelised with ``parallelize_module``."""

    name = "tensor_parallel"

    def __init__(self, mesh: Any) -> None:
        super().__init__(LocalGradAccess())
        if mesh.ndim != 1:
            raise NotImplementedError("kaisa: tensor parallelism on a 1-D (tp) mesh only")
        self.ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        self.tp_rank = self.ranks.index(dist.get_rank())
        self.mesh = mesh
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
        if self._default is None and len(self.ranks) == dist.get_world_size():
            me = dist.new_group([dist.get_rank()], use_local_synchronization=True)
            self._default = Topology(dp=me, tp=self.mesh.get_group())
        return EngineDefaults(topology=self._default)

    # -- construction ------------------------------------------------------------
    def select_layers(
        self, adapters: list[LayerAdapter], skipped: list[SkippedModule], config: KFACConfig
    ) -> list[LayerAdapter]:
        self.mode = TensorParallelMode(config.tensor_parallel)
        kept: list[LayerAdapter] = []
        sharded: list[tuple[LayerAdapter, Style]] = []
        for adapter in adapters:
            style = _style(adapter.weight)
            if style is None:
                kept.append(adapter)
            elif type(adapter) is LinearAdapter:
                sharded.append((adapter, style))
            else:
                kind = type(adapter.module).__name__
                why = f"sharded {kind}: kaisa's tensor parallelism supports nn.Linear only"
                skipped.append(SkippedModule(adapter.name, kind, why, tuple(adapter.param_names())))
        if self.mode is TensorParallelMode.BLOCK:
            for adapter, style in sharded:
                module, name = adapter.module, adapter.name
                kept.append(ShardBlockAdapter(name, module, style, len(self.ranks), self.tp_rank))
                if style is Style.ROWWISE and adapter.has_bias:
                    kept.append(ReplicatedBiasAdapter(name, module))
            return kept
        costs = [float(a.a_dim**3 + a.g_dim**3) for a, _ in sharded]
        primaries = assign_primaries(costs, len(self.ranks))
        for (adapter, style), primary in zip(sharded, primaries):
            exact = ExactShardedAdapter(adapter.name, adapter.module, style, primary)
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
                "topology.tp must be the tensor-parallel group of the sharded layers' mesh "
                f"(ranks {list(self.ranks)}): pass kaisa.Topology(dp=mesh['dp'].get_group(), "
                "tp=mesh['tp'].get_group())"
            )
        if set(comm.global_ranks) & set(self.ranks) != {dist.get_rank()}:
            raise ValueError("topology.dp and topology.tp must meet in this rank only")
        self.group = TPGroup(self.ranks, comm.stats, comm.timeout_s)
        if self.exact:
            by_name = {la.name: la for la in layers}
            hooks = _ExactCapture(capture, self.group, by_name)
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
        me = dist.get_rank()
        flags = torch.zeros(len(self.exact), dtype=torch.int32, device=self.exact[0].device)
        for j, a in enumerate(self.exact):
            if a.name in index:  # this rank is the primary and the layer takes part
                flags[j] = 2 if me in workers[index[a.name]] else 1
        self._flags = [int(f) for f in self.group.sum(flags).tolist()]
        for name, matrix in self._gather_gradients().items():
            out[index[name]] = matrix
        return out

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


class _ExactCapture:
    """Forward hooks on every exact-mode layer, on every tensor-parallel rank.

    Each decides with :meth:`Capture.accepts` (the same answer on every rank)
    whether the call is captured; if so it gathers the shards the primary
    needs — the input of a rowwise layer now, the output gradient of a
    colwise layer when it arrives — and, on the primary, hands the full
    tensors to :meth:`Capture.observe`.
    """

    def __init__(self, capture: Capture, group: TPGroup, layers: dict[str, KFACLayer]) -> None:
        self.capture = capture
        self.group = group
        self.layers = layers

    def install(self, adapters: list[ExactShardedAdapter]) -> list[Any]:
        return [a.module.register_forward_hook(_Hook(self._hook(a), a.module)) for a in adapters]

    def _hook(self, adapter: ExactShardedAdapter) -> Callable[[nn.Module, Any, Any], None]:
        group, capture = self.group, self.capture
        layer = self.layers.get(adapter.name)  # None where this rank is not the primary

        def gather(full: int) -> Callable[[Tensor], Tensor | None]:
            return lambda t: group.gather_last_dim(local(t).detach(), adapter.primary, full)

        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            x = _first_tensor(inputs)
            if x is None or not isinstance(output, Tensor):
                return
            if not capture.accepts(adapter, module, output):
                return
            if adapter.style is Style.ROWWISE:
                full_x = gather(adapter.in_features)(x)
                if layer is not None and full_x is not None:
                    capture.observe(layer, module, full_x, output, grad_view=local)
                return
            view = gather(adapter.out_features)
            if layer is not None:
                capture.observe(layer, module, local(x), output, grad_view=view)  # type: ignore[arg-type]
            else:
                output.register_hook(lambda g: _discard(view(g)))

        return hook


def _discard(_: Any) -> None:
    return None
