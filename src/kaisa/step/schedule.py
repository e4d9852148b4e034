"""Hyperparameters as functions of the K-FAC step.

Every schedule-like option may be a number or a callable of the step
(kfac-pytorch's convention); values are validated each time they are read.
The learning rate the KL clip assumes is read from the optimizer's first
param group when the user gave an optimizer and no ``lr``.  A checkpoint
restores the non-callable schedule values, as ``torch.optim`` restores its
param groups; structural options (method, fraction, dtypes) are not.

The current values may be changed during training (``precond.damping =
…``, validated at once, or kfac-pytorch's ``LambdaParamScheduler`` writing
``precond._damping``, checked when next used), as kfac-pytorch allows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from kaisa.config import KFACConfig, check_value, plain_number, resolve
from kaisa.warn import warn_user

__all__ = ["FixedValues", "Schedule", "warn_unaligned_intervals"]

_UNSEEN = object()
_IMMUTABLE = (int, float, type(None))

#: the options a checkpoint restores
RESTORED = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")


@dataclasses.dataclass(frozen=True)
class FixedValues:
    """The schedule options a non-factor step reads, at one
    :attr:`Schedule.revision`, each a constant (read by a replayed step
    without six lookups)."""

    revision: int
    factor_every: int
    inverse_every: int
    damping: float
    kl_clip: float | None
    #: None: the optimizer's learning rate, read at each step
    lr: float | None


class Schedule:
    """The current values of the schedule options."""

    def __init__(
        self, config: KFACConfig, optimizer: torch.optim.Optimizer | None, lr_from_optimizer: bool
    ) -> None:
        self._config = config
        self.optimizer = optimizer
        self.lr_from_optimizer = lr_from_optimizer
        #: the schedule options' current values: numbers or callables of the step
        self.values: dict[str, Any] = {k: getattr(config, k) for k in RESTORED}
        #: the constants among them already validated (by identity)
        self._valid: dict[str, Any] = {}
        #: counts the changes of :attr:`values` (``set``, ``restore``)
        self.revision = 0
        self._fixed: FixedValues | None = None

    @property
    def config(self) -> KFACConfig:
        """The options, with the schedule options at their current values."""
        changed = {k: v for k, v in self.values.items() if v is not getattr(self._config, k)}
        return dataclasses.replace(self._config, **changed) if changed else self._config

    def hyperparameters(self) -> dict[str, Any]:
        """The non-callable options a checkpoint keeps: the learning rate only
        where it is the preconditioner's own (one read from the optimizer is
        the optimizer's to save; saved here, a load would impose a value no
        step used on a preconditioner given an lr of its own)."""
        saved = self.config.hyperparameters()
        if self.lr_from_optimizer:
            saved.pop("lr", None)
        return saved

    def value(self, name: str, step: int) -> Any:
        """The option at ``step``, validated; a constant is validated the
        first time it is read (read six times a step, it is then returned
        as is: a new value, set or restored, is a new object)."""
        held = self.values[name]
        if self._valid.get(name, _UNSEEN) is held:
            return held
        result = resolve(name, held, step)
        if type(held) in _IMMUTABLE:  # not a callable, nor a tensor changed in place
            self._valid[name] = held
        return result

    def current(self, name: str, step: int) -> Any:
        """The option's value at ``step`` as set, unvalidated (a view for users:
        what is out of range is refused when the step uses it)."""
        if name == "lr" and self.lr_from_optimizer:
            return self.lr(step)
        value = self.values[name]
        return value(step) if callable(value) else value

    def stored(self, name: str) -> Any:
        """The option as held: a number or a callable (the learning rate read
        from the optimizer is a callable of the step)."""
        if name == "lr" and self.lr_from_optimizer:
            return self.lr
        return self.values[name]

    def set(self, name: str, value: Any, *, check: bool) -> None:
        """Change an option; ``check`` validates now rather than at its next use.
        ``lr`` None goes back to reading the optimizer's learning rate."""
        if name == "lr" and value is None:
            if self.optimizer is None:
                raise ValueError(
                    "lr=None reads the optimizer's learning rate, but this preconditioner was "
                    "given no optimizer; set a number or a callable of the step"
                )
            self.lr_from_optimizer = True
            self.revision += 1
            return
        value = plain_number(name, value)
        if check:
            check_value(name, value)
        if name == "lr":
            self.lr_from_optimizer = False
        self.values[name] = value
        self.revision += 1

    def fixed(self) -> FixedValues | None:
        """The values a non-factor step reads, while the schedule is not
        changed, where each is a constant (None where one is a callable of
        the step or a tensor, which may change in place); validated as
        :meth:`value` does."""
        if self._fixed is not None and self._fixed.revision == self.revision:
            return self._fixed
        read = ("factor_update_steps", "inv_update_steps", "damping", "kl_clip", "lr")
        names = [k for k in read if not (k == "lr" and self.lr_from_optimizer)]
        if any(type(self.values[k]) not in _IMMUTABLE for k in names):
            return None
        self._fixed = FixedValues(
            self.revision,
            int(self.value("factor_update_steps", 0)),
            int(self.value("inv_update_steps", 0)),
            self.damping(0),
            self.kl_clip(0),
            None if self.lr_from_optimizer else float(self.value("lr", 0)),
        )
        return self._fixed

    def lr(self, step: int) -> float:
        value = self.lr_operand(step)
        return float(value.item() if isinstance(value, Tensor) else value)

    def lr_operand(self, step: int) -> float | Tensor:
        """The learning rate as the step uses it: an optimizer's tensor
        learning rate (a compiled or capturable optimizer's) stays a tensor,
        which the step reads on the device (reading it as a number would
        synchronise an accelerator every step)."""
        if self.lr_from_optimizer:
            assert self.optimizer is not None
            value = self.optimizer.param_groups[0]["lr"]
            return value if isinstance(value, Tensor) else float(value)
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

    def restorable(self, saved: object) -> dict[str, Any]:
        """The saved schedule values this schedule would take from a checkpoint
        (``saved``: its ``'hyperparameters'``, refused unless a mapping)."""
        if not isinstance(saved, Mapping):
            raise ValueError(
                "a checkpoint's 'hyperparameters' must be a mapping of option names to "
                f"values; got {type(saved).__name__}"
            )
        return {
            k: saved[k]
            for k in RESTORED
            if k in saved
            and not callable(self.values[k])
            and not (k == "lr" and self.lr_from_optimizer)
        }

    def fix(self, **values: Any) -> None:
        """Options that are not scheduled, changed between steps."""
        self._config = dataclasses.replace(self._config, **values)

    def restore(self, values: Mapping[str, Any]) -> None:
        """Take checkpointed values (validated by :class:`KFACConfig`'s checks)."""
        if values:
            self._config = dataclasses.replace(self._config, **values)
            self.values.update(values)
            self.revision += 1


def warn_unaligned_intervals(config: KFACConfig) -> None:
    """Decompositions between factor updates reuse unchanged factors: say so."""
    f, i = config.factor_update_steps, config.inv_update_steps
    if isinstance(f, int) and isinstance(i, int) and i % f != 0:
        warn_user(
            f"inv_update_steps ({i}) is not a multiple of factor_update_steps ({f}): some "
            "decompositions will reuse unchanged factors",
        )
