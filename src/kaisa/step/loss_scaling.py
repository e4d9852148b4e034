"""Loss scaling (``torch.amp.GradScaler`` or any callable returning the scale).

Three things depend on the scaler:

* the output gradients the hooks see are multiplied by the scale, which the
  G factor divides out (:meth:`LossScaling.scale`, read on device);
* ``precond.step()`` must see *unscaled* gradients, or the KL clip would
  shrink the update by the scale: :meth:`LossScaling.check_unscaled` refuses
  a step before ``scaler.unscale_(optimizer)``;
* a step whose gradients hold an Inf/NaN is skipped by the scaler, and must
  leave kaisa exactly as it was: :meth:`LossScaling.found_inf` reads the
  scaler's own verdict from ``unscale_`` (``None`` when it has none, e.g.
  for a callable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from kaisa.config import check_number, plain_number

__all__ = ["LossScaling", "unscale_once"]


def unscale_once(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)`` unless it ran since the last
    ``update()``: for a loop whose optimizer step unscales (accelerate's),
    where K-FAC must see the true gradients first.  A scaler that is not a
    ``GradScaler``, or is disabled, is left alone."""
    if not callable(getattr(scaler, "unscale_", None)):
        return
    if not bool(getattr(scaler, "is_enabled", lambda: True)()):
        return
    states = getattr(scaler, "_per_optimizer_states", {})
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    if getattr((state or {}).get("stage"), "name", None) != "UNSCALED":
        scaler.unscale_(optimizer)


class LossScaling:
    """The preconditioner's view of a grad scaler."""

    def __init__(self, grad_scaler: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.scaler = grad_scaler
        self.optimizers = tuple(optimizers)
        self._is_amp = callable(getattr(grad_scaler, "get_scale", None))

    @property
    def active(self) -> bool:
        if self.scaler is None:
            return False
        return not self._is_amp or bool(getattr(self.scaler, "is_enabled", lambda: True)())

    def scale(self) -> Tensor | float | None:
        """The current loss scale (a device tensor for a GradScaler: no sync)."""
        if not self.active:
            return None
        if not self._is_amp:
            value = self.scaler()
            if isinstance(value, Tensor):
                return value  # on its device: read there, unchecked (a check would sync)
            value = plain_number("loss scale", value)  # a numpy scale is a number too
            check_number("the loss scale grad_scaler() returns", value, low=0, low_open=True)
            return float(value)
        getter = getattr(self.scaler, "_get_scale_async", None)
        return getter() if getter is not None else self.scaler.get_scale()

    def getter(self) -> Callable[[], Tensor | float | None] | None:
        return self.scale if self.scaler is not None else None

    def _states(self) -> list[dict[str, Any]]:
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict):
            return []
        if self.optimizers:
            found = (states.get(id(o)) for o in self.optimizers)
            return [state for state in found if state is not None]
        return list(states.values())

    def check_unscaled(self) -> None:
        """Raise if a GradScaler is active and ``unscale_`` was not called this step."""
        if not (self._is_amp and self.active) or not hasattr(self.scaler, "unscale_"):
            return
        stages = [getattr(s.get("stage"), "name", None) for s in self._states()]
        if self.optimizers:  # every optimizer given: each holds gradients kaisa reads
            unscaled = len(stages) == len(self.optimizers) and set(stages) == {"UNSCALED"}
        else:
            unscaled = "UNSCALED" in stages
        if not unscaled:
            raise RuntimeError(
                "kaisa: grad_scaler is set but the gradients are still scaled: call "
                "scaler.unscale_(optimizer) (for each optimizer given) after backward and "
                "before precond.step() (then "
                "scaler.step(optimizer) and scaler.update() as usual); the KL clip needs the "
                "true gradients"
            )

    def found_inf(self) -> Tensor | None:
        """1 if ``unscale_`` found an Inf/NaN in this step's gradients, else 0 (on device)."""
        if not (self._is_amp and self.active):
            return None
        flags = [
            t.reshape(()).to(torch.float32)
            for s in self._states()
            if getattr(s.get("stage"), "name", None) == "UNSCALED"
            for t in s.get("found_inf_per_device", {}).values()
        ]
        if not flags:
            return None
        return torch.stack([f.to(flags[0].device) for f in flags]).amax()
