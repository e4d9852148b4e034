"""Learning-rate schedules of ``kaisa train``/``compare``: constant or warm-up + cosine.

A fair time-to-target comparison needs a tuned baseline, and first-order
baselines are usually tuned with a warm-up and a decaying schedule; both arms
get the same schedule so only the preconditioner differs. The schedule is
applied per optimizer step by writing ``param_groups[*]['lr']`` before the
step; K-FAC reads its lr from the optimizer, so its KL clip follows.

``constant`` with no warm-up never writes the lr at all, so it is bit-identical
to training without a schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SCHEDULES", "LRSchedule"]

#: Names accepted by ``--schedule``.
SCHEDULES: tuple[str, ...] = ("constant", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up for ``warmup_steps`` steps, then constant or cosine to zero.

    Step ``s`` is 0-based (the step about to be taken). During warm-up the lr
    is ``base * (s + 1) / warmup_steps``, so the first step already moves the
    weights; the cosine part decays from ``base`` at the end of warm-up to 0
    at ``total_steps``: ``base * (1 + cos(pi * (s - w) / (total - w))) / 2``.
    """

    name: str
    base_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.name!r}")
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"base_lr must be a positive number; got {self.base_lr}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(
                f"need warmup_steps >= 0 and total_steps >= 1; got {self.warmup_steps}, "
                f"{self.total_steps}"
            )
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warm-up ({self.warmup_steps} steps) is longer than training "
                f"({self.total_steps} steps)"
            )

    @classmethod
    def from_epochs(
        cls, name: str, base_lr: float, warmup_epochs: float, epochs: int, steps_per_epoch: int
    ) -> LRSchedule:
        """The schedule of a run of ``epochs`` x ``steps_per_epoch`` steps."""
        warmup = round(warmup_epochs * steps_per_epoch)
        return cls(name, base_lr, warmup, epochs * steps_per_epoch)

    @property
    def is_identity(self) -> bool:
        """Whether the lr never changes (then it is never written)."""
        return self.name == "constant" and self.warmup_steps == 0

    def lr(self, step: int) -> float:
        """The learning rate of 0-based step ``step``."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.name == "constant":
            return self.base_lr
        span = self.total_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
