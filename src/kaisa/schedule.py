"""Hyperparameters as functions of the K-FAC step.

Every schedule-like option may be a number or a callable of the step
(kfac-pytorch's convention); values are validated each time they are read.
The learning rate the KL clip assumes is read from the optimizer's first
param group when the user gave an optimizer and no ``lr``.  A checkpoint
restores the non-callable schedule values, as ``torch.optim`` restores its
param groups; structural options (method, fraction, dtypes) are not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from kaisa.config import KFACConfig, resolve

__all__ = ["Schedule"]

#: the options a checkpoint restores
RESTORED = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")


class Schedule:
    """The current values of the schedule options."""

    def __init__(
        self, config: KFACConfig, optimizer: torch.optim.Optimizer | None, lr_from_optimizer: bool
    ) -> None:
        self.config = config
        self.optimizer = optimizer
        self.lr_from_optimizer = lr_from_optimizer

    def value(self, name: str, step: int) -> Any:
        return resolve(name, getattr(self.config, name), step)

    def lr(self, step: int) -> float:
        if self.lr_from_optimizer:
            assert self.optimizer is not None
            value = self.optimizer.param_groups[0]["lr"]
            return float(value.item() if isinstance(value, Tensor) else value)
        return float(self.value("lr", step))

    def damping(self, step: int) -> float:
        return float(self.value("damping", step))

    def factor_decay(self, step: int) -> float:
        return float(self.value("factor_decay", step))

    def kl_clip(self, step: int) -> float | None:
        value = self.value("kl_clip", step)
        return None if value is None else float(value)

    def is_factor_step(self, step: int) -> bool:
        return step % int(self.value("factor_update_steps", step)) == 0

    def is_inverse_step(self, step: int) -> bool:
        return step % int(self.value("inv_update_steps", step)) == 0

    def restorable(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The saved schedule values this schedule would take from a checkpoint."""
        return {
            k: saved[k]
            for k in RESTORED
            if k in saved
            and not callable(getattr(self.config, k))
            and not (k == "lr" and self.lr_from_optimizer)
        }

    def restore(self, values: Mapping[str, Any]) -> None:
        """Take checkpointed values (validated by :class:`KFACConfig`)."""
        if values:
            self.config = dataclasses.replace(self.config, **values)
