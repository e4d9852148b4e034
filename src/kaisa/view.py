"""What the preconditioner's mixins see of it (for type checking only).

:class:`kaisa.KFACPreconditioner` is assembled from its own methods and two
mixins, kfac-pytorch's attributes (:mod:`kaisa.compat`) and the checkpoint
methods (:mod:`kaisa.checkpoint.facade`); both read the same few attributes
of the preconditioner, declared here once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the facade's modules import this one: nothing at run time
    from kaisa.config import KFACConfig
    from kaisa.distributed.plan import WorkPlan
    from kaisa.step.schedule import Schedule

__all__ = ["PreconditionerView"]


class PreconditionerView:
    """The schedule, the step's parts, and the views the facade defines."""

    _schedule: Schedule
    _parts: Any

    if TYPE_CHECKING:

        @property
        def steps(self) -> int: ...

        @property
        def plan(self) -> WorkPlan: ...

        @property
        def config(self) -> KFACConfig: ...

        @property
        def rank(self) -> int: ...
