"""Where a preconditioner sits in the job: its data-parallel group and the
groups that hold the other parts of the same model.

A :class:`Topology` is a plain, immutable description; :mod:`kaisa.comm`
turns it into ranks and process groups.  The work plan, every factor
reduction and second-order broadcast, and the checkpoint run over the
data-parallel group ``dp`` only — never over the world.  Ranks in ``tp``
(tensor parallel) and ``pp`` (pipeline parallel) hold *other* layers or
other shards of the same model, so the only thing summed over them is the
KL clip's inner product ``Σ⟨V, ∇⟩``: the clip then scales the whole model's
update as one, exactly as in a single process.
"""

from __future__ import annotations

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
    """

    dp: Any = None
    tp: Any = None
    pp: Any = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if value is not None and not hasattr(value, "size"):
                raise TypeError(
                    f"Topology.{name} must be a torch.distributed ProcessGroup or None; "
                    f"got {type(value).__name__}"
                )

    @property
    def model_parallel(self) -> tuple[Any, ...]:
        """The groups over which the KL clip's inner product is summed."""
        return tuple(g for g in (self.tp, self.pp) if g is not None)
