"""Where a preconditioner sits in the job: its data-parallel group and the
groups that hold the other parts of the same model.

A :class:`Topology` is a plain, immutable description; :mod:`kaisa.distributed.communicator`
turns it into ranks and process groups.  The work plan, every factor
reduction and second-order broadcast, and the checkpoint run over the
data-parallel group ``dp`` only — never over the world.  Ranks in ``tp``
(tensor parallel) and ``pp`` (pipeline parallel) hold *other* layers or
other shards of the same model, so the only thing summed over them is the
KL clip's inner product ``Σ⟨V, ∇⟩``: the clip then scales the whole model's
update as one, exactly as in a single process.

A topology made from a ``DeviceMesh`` (:meth:`Topology.from_mesh`) also
carries its data-parallel dimension as a mesh: kaisa's gradient-worker and
receiver groups are then two dimensions unflattened from it, so they
compose with its tensor- and pipeline-parallel dimensions and are created
by torch's mesh machinery (one ``split_group`` per dimension on NCCL), not
one ``new_group`` call per group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """Process groups of one preconditioner.

    Args:
        dp: the data-parallel group whose ranks hold the same layers and see
            different data (``None``: the default group, i.e. the world; a
            single process when ``torch.distributed`` is not initialised).
        tp: ranks that hold other shards of this rank's layers, or other
            layers, in tensor parallelism (``None``: none).
        pp: ranks that hold the other pipeline stages (``None``: none).
        dp_mesh: the one-dimensional ``DeviceMesh`` of the data-parallel
            ranks, cut from the job's mesh by :meth:`from_mesh` (``None``
            without a mesh); kaisa's worker and receiver groups are
            unflattened from it.
    """

    dp: Any = None
    tp: Any = None
    pp: Any = None
    dp_mesh: Any = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if value is not None and not hasattr(value, "size"):
                raise TypeError(
                    f"Topology.{name} must be a torch.distributed ProcessGroup or None; "
                    f"got {type(value).__name__}"
                )
        if self.dp_mesh is not None and getattr(self.dp_mesh, "ndim", None) != 1:
            raise ValueError(
                "Topology.dp_mesh must be a one-dimensional DeviceMesh; use Topology.from_mesh()"
            )

    @classmethod
    def from_mesh(
        cls,
        mesh: Any,
        dp: str | Sequence[str] = "dp",
        tp: str | None = None,
        pp: str | None = None,
    ) -> Topology:
        """The topology of a ``torch.distributed.device_mesh.DeviceMesh``.

        Args:
            mesh: the job's mesh, e.g. ``init_device_mesh("cuda", (8, 4),
                mesh_dim_names=("dp", "tp"))``.
            dp: the name of the data-parallel dimension, or several names
                (e.g. HSDP's ``("replicate", "shard")``) flattened into one.
            tp: the tensor-parallel dimension's name, if any.
            pp: the pipeline-parallel dimension's name, if any.
        """
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if not names or not callable(getattr(mesh, "get_group", None)):
            raise TypeError(
                "Topology.from_mesh needs a DeviceMesh with mesh_dim_names; got "
                f"{type(mesh).__name__}"
                + (" without dimension names" if hasattr(mesh, "get_group") else "")
            )
        dp_dims = (dp,) if isinstance(dp, str) else tuple(dp)
        given = {"dp": dp_dims, "tp": (tp,) if tp else (), "pp": (pp,) if pp else ()}
        for arg, dims in given.items():
            unknown = [d for d in dims if d not in names]
            if unknown or (arg == "dp" and not dims):
                raise ValueError(
                    f"Topology.from_mesh: {arg}={unknown or list(dims)} must name dimensions of "
                    f"the mesh; its dimensions are {list(names)}"
                )
        overlap = set(dp_dims) & {tp, pp}
        if overlap or (tp is not None and tp == pp):
            raise ValueError(
                f"Topology.from_mesh: dp={list(dp_dims)}, tp={tp!r} and pp={pp!r} must be "
                "different dimensions"
            )
        dp_mesh = _submesh(mesh, dp_dims)
        return cls(
            dp=dp_mesh.get_group(),
            tp=mesh.get_group(tp) if tp else None,
            pp=mesh.get_group(pp) if pp else None,
            dp_mesh=dp_mesh,
        )

    @property
    def model_parallel(self) -> tuple[Any, ...]:
        """The groups over which the KL clip's inner product is summed."""
        return tuple(g for g in (self.tp, self.pp) if g is not None)


def _submesh(mesh: Any, dims: tuple[str, ...]) -> Any:
    """``mesh[dims]`` as one dimension (several are flattened, as HSDP's are)."""
    if len(dims) == 1:
        return mesh[dims[0]]
    return mesh[dims]._flatten("_".join(dims))
