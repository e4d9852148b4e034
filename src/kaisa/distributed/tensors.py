"""What ``torch.distributed``'s sharded tensors and modules are: FSDP2
modules, DTensor placements, the local shard and the group behind them.

The engines ask these questions of a model or a gradient; the answers are
plain Python (a bool, a dimension, a local tensor and a process group), so
no engine imports ``torch.distributed``.  ``torch.distributed.fsdp`` and
``torch.distributed.tensor`` are imported only when asked: a torch built
without them answers "not sharded".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

__all__ = [
    "fsdp_mesh",
    "is_fsdp2_model",
    "linear_shard_dim",
    "mesh_group",
    "row_shard",
    "shard_meshes",
]


def is_fsdp2_model(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (or any submodule)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_mesh(module: nn.Module) -> Any:
    """The one-dimensional mesh ``fully_shard`` sharded ``module`` over, if any."""
    if not is_fsdp2_model(module):
        return None
    mesh = next((getattr(p, "device_mesh", None) for p in module.parameters()), None)
    return mesh if mesh is not None and mesh.ndim == 1 else None


def mesh_group(mesh: Any, dim: int | None = None) -> Any:
    """The process group of a ``DeviceMesh`` (of dimension ``dim`` on a
    multi-dimensional one)."""
    return mesh.get_group() if dim is None else mesh.get_group(dim)


def row_shard(grad: Any) -> tuple[Tensor, Any]:
    """The local rows of an FSDP2 ``Shard(0)`` DTensor gradient and the
    process group it is sharded over.  Under HSDP (a 2-D mesh placed
    ``(Replicate(), Shard(0))``) every replica holds the same averaged rows,
    so the group is this rank's shard group only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(grad, DTensor):
        raise TypeError(f"expected a DTensor gradient under FSDP2; got {type(grad).__name__}")
    placements = tuple(grad.placements)
    if placements == (Shard(0),):
        return grad.to_local(), grad.device_mesh.get_group()
    if placements == (Replicate(), Shard(0)):
        return grad.to_local(), grad.device_mesh.get_group(1)
    raise NotImplementedError(
        "kaisa's FSDP2 engine supports Shard(0) gradients on a one-dimensional mesh and "
        f"(Replicate(), Shard(0)) on HSDP's two-dimensional one; got placements {placements} "
        f"on a {grad.device_mesh.ndim}-D mesh"
    )


def _is_sharded(param: Any) -> bool:
    placements = getattr(param, "placements", None) or ()
    return any(p.is_shard() for p in placements)


def linear_shard_dim(param: Any) -> int | None:
    """The dimension a ``parallelize_module`` weight is split on: 0
    (``ColwiseParallel``, ``Shard(0)``) or 1 (``RowwiseParallel``,
    ``Shard(1)``) on a one-dimensional mesh; None for a tensor that is not a
    sharded DTensor."""
    if not _is_sharded(param):
        return None
    from torch.distributed.tensor import Shard

    placements = tuple(param.placements)
    for dim in (0, 1):
        if placements == (Shard(dim),):
            return dim
    raise NotImplementedError(
        f"kaisa: a weight placed {placements} is not supported; tensor parallelism "
        "supports ColwiseParallel (Shard(0)) and RowwiseParallel (Shard(1)) on a 1-D mesh"
    )


def shard_meshes(model: nn.Module) -> Iterator[tuple[tuple[int, ...], Any]]:
    """The global ranks (in mesh order) and process group of the mesh of every
    sharded DTensor parameter of ``model`` (one-dimensional meshes only)."""
    for param in model.parameters():
        if _is_sharded(param):
            mesh = param.device_mesh  # type: ignore[attr-defined]
            if mesh.ndim != 1:
                raise NotImplementedError("kaisa: tensor parallelism on a 1-D (tp) mesh only")
            yield tuple(int(r) for r in mesh.mesh.flatten().tolist()), mesh.get_group()
