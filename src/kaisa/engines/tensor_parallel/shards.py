"""Which layers of a model are sharded over a tensor-parallel group, how, and
over which group — the one question the tensor-parallel engine asks of a
layer, answered for both frameworks:

* ``parallelize_module``: an ``nn.Linear`` whose weight is a DTensor placed
  ``Shard(0)`` (``ColwiseParallel``) or ``Shard(1)`` (``RowwiseParallel``) on
  a 1-D mesh; the group is the mesh's, shard ``t`` on mesh position ``t``;
* Megatron-core: a ``ColumnParallelLinear`` / ``RowParallelLinear`` with a
  partitioned weight (:mod:`kaisa.layers.megatron`); the group is the
  layer's ``tp_group``, shard ``t`` on group rank ``t``.

Everything after this module sees only a
:class:`~kaisa.layers.tensor_parallel.Sharding` and a group.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn

from kaisa.distributed.collectives import group_ranks
from kaisa.distributed.tensors import linear_shard_dim, shard_meshes
from kaisa.layers.base import LayerAdapter
from kaisa.layers.linear import LinearAdapter
from kaisa.layers.megatron import MegatronLinearAdapter, megatron_sharding, megatron_tp_group
from kaisa.layers.tensor_parallel import Sharding, Style

__all__ = ["TPGroupOf", "is_sharded", "sharding_of", "tensor_parallel_group"]


class TPGroupOf(NamedTuple):
    """A model's tensor-parallel group: the process group and its global
    ranks in shard order (position ``t`` holds shard ``t``)."""

    group: Any
    ranks: tuple[int, ...]


def _dtensor_style(param: Any) -> Style | None:
    """The sharding of a DTensor weight on a one-dimensional mesh, if any."""
    dim = linear_shard_dim(param)
    if dim is None:
        return None
    return Style.COLWISE if dim == 0 else Style.ROWWISE


def is_sharded(adapter: LayerAdapter) -> bool:
    """Whether the layer's weight is split over the tensor-parallel group."""
    if isinstance(adapter, MegatronLinearAdapter):
        return adapter.sharding() is not None
    return _dtensor_style(adapter.weight) is not None


def sharding_of(adapter: LayerAdapter) -> Sharding | None:
    """How a sharded linear layer is split (None: not a linear kaisa can
    precondition sharded, e.g. a sharded Embedding)."""
    if isinstance(adapter, MegatronLinearAdapter):
        return adapter.sharding()
    if type(adapter) is not LinearAdapter:
        return None
    style = _dtensor_style(adapter.weight)
    if style is None:
        return None
    return Sharding(style, adapter.in_features, adapter.out_features)


def _groups(model: nn.Module) -> dict[tuple[int, ...], tuple[str, Any]]:
    """Every tensor-parallel group the model's sharded layers use, by ranks."""
    found: dict[tuple[int, ...], tuple[str, Any]] = {}
    for ranks, group in shard_meshes(model):
        found.setdefault(ranks, ("parallelize_module", group))
    for module in model.modules():
        if megatron_sharding(module) is not None:
            group = megatron_tp_group(module)
            ranks = group_ranks(group)
            found.setdefault(ranks, ("Megatron", group))
    return found


def tensor_parallel_group(model: nn.Module) -> TPGroupOf | None:
    """The one tensor-parallel group of the model's sharded layers (None: none)."""
    found = _groups(model)
    if len(found) > 1:
        kinds = sorted({kind for kind, _ in found.values()})
        raise NotImplementedError(
            f"kaisa: sharded layers ({' and '.join(kinds)}) on {len(found)} different "
            f"tensor-parallel groups {sorted(found)}; one group per model is supported"
        )
    for ranks, (_, group) in found.items():
        return TPGroupOf(group, ranks)
    return None
