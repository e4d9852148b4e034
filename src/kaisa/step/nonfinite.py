"""Steps whose gradients are not finite: found once per step, skipped, counted.

A NaN or Inf loss makes every gradient of the step non-finite.  Preconditioning
them would fold the step's statistics into the running factors (its output
gradients are non-finite too) and write ``NaN`` through the KL clip, so kaisa
skips such a step exactly as it skips one a ``GradScaler`` skips: no factor
fold (the step's captured statistics are dropped), no decomposition, the
gradients left as they are (the optimizer, or the user, decides what to do
with them) and the step counter not advanced.

Where a ``GradScaler`` (or the engine's own scaler) has a verdict, that
verdict is used and nothing is checked here.  Otherwise the registered
layers' gradients are checked with one fused norm per device and dtype and
one host read of a scalar per step: free on CPU; on an accelerator the one
synchronisation of a step that otherwise has none off its factor and
inverse steps.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NonFiniteSteps", "gradients_finite"]


def _norms(grads: Sequence[Tensor]) -> list[Tensor]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    norms: list[Tensor] = []
    for group in groups.values():
        norms.extend(torch._foreach_norm(group, 2.0))
    return norms


def gradients_finite(grads: Sequence[Tensor]) -> bool:
    """Whether every entry of ``grads`` is finite.

    The L2 norm propagates a NaN on every device and gives Inf for an Inf
    entry — and also when the squares of finite entries overflow, so an
    infinite norm is settled by an exact per-tensor check (rare: it costs a
    pass and a read per tensor)."""
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return True
    norms = _norms(grads)
    device = norms[0].device
    total = float(torch.stack([n.to(device, torch.float64) for n in norms]).sum())
    if math.isfinite(total):
        return True
    if math.isnan(total):
        return False
    return all(bool(torch.isfinite(g).all()) for g in grads)


class NonFiniteSteps:
    """Counts the steps skipped for non-finite gradients and says so: at the
    1st, 2nd, 4th, 8th … skip, so a run that keeps producing them is told
    how many without a warning per step."""

    def __init__(self) -> None:
        self.count = 0

    def record(self, step: int) -> None:
        self.count += 1
        if self.count & (self.count - 1):  # not a power of two
            return
        warnings.warn(
            f"kaisa: skipped {self.count} step(s) with non-finite gradients so far (the latest "
            f"at step {step}): their statistics were dropped, the factors, decompositions and "
            "step count left as they were, and the gradients left unchanged. A NaN or Inf "
            f"loss is the usual cause; the next report comes at {2 * self.count} skips",
            stacklevel=5,
        )
