"""What one step's phases read, fixed when the step starts.

The orchestrator (:mod:`kaisa.step.pipeline`) forms a :class:`StepContext`
from the schedule and the step's verdict and hands it down; a phase reads
it and never keeps it, so nothing of one step lingers into the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor

__all__ = ["StepContext"]


@dataclass(frozen=True)
class StepContext:
    """One step's values.

    Attributes:
        step: the step's index (steps taken before it).
        factor_step: the factors were updated this step (a layer seen for
            the first time may take part).
        damping: the damping (a 0-d tensor inside a recorded step).
        lr: the learning rate the KL clip reads (an optimizer's tensor, or a number).
        kl_clip: the KL clip's bound; None: no clip.
        presence: each layer's gradient presence, already and-ed over the
            data-parallel group by the finiteness check (None: not agreed yet).
        verdict_of: where the finiteness verdict stays on the device, what
            forms it from the gradients before they change (None: settled).
    """

    step: int
    factor_step: bool
    damping: float | Tensor
    lr: float | Tensor
    kl_clip: float | Tensor | None
    presence: Mapping[str, bool] | None = None
    verdict_of: Callable[[], Tensor | None] | None = None

    @property
    def clip(self) -> tuple[float | Tensor, float | Tensor] | None:
        """``(lr, kl_clip)``, or None without a clip."""
        return None if self.kl_clip is None else (self.lr, self.kl_clip)

    def replace(self, **changes: object) -> StepContext:
        """This context with ``changes`` (a recorded step's tensor operands)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
