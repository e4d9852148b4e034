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
one host read of a scalar per step — free on CPU.  On an accelerator a
non-factor step reads nothing (:mod:`kaisa.step.pipeline` decides): its
verdict stays on the device (:func:`finite_verdict`) and is read with the
others at the next factor step (:meth:`NonFiniteSteps.settle`), where the
step synchronises anyway.  Such a step is not skipped — it changes no
factor or decomposition either way — but it is counted and reported.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NonFiniteSteps", "finite_verdict", "gradients_finite"]


def _groups(grads: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def _norms(grads: Sequence[Tensor]) -> list[Tensor]:
    norms: list[Tensor] = []
    for group in _groups(grads).values():
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


def finite_verdict(grads: Sequence[Tensor]) -> Tensor | None:
    """Whether every entry of ``grads`` is finite, as a 0-d bool on their
    device and with no host read: the largest magnitude (``∞``-norm) is
    finite exactly when every entry is (it cannot overflow as a sum of
    squares can).  None: nothing to check."""
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return None
    device = grads[0].device
    # one fused norm per device and dtype, reduced there: the conversions are
    # per group, not per tensor (a launch each on an accelerator)
    largest = [
        torch.stack(torch._foreach_norm(group, math.inf)).amax().to(device, torch.float32)
        for group in _groups(grads).values()
    ]
    return torch.isfinite(torch.stack(largest).amax())


class NonFiniteSteps:
    """Counts the steps skipped for non-finite gradients and says so: at the
    1st, 2nd, 4th, 8th … skip, so a run that keeps producing them is told
    how many without a warning per step."""

    def __init__(self) -> None:
        self.count = 0
        #: (step, verdict on device) of steps run without reading it (:meth:`defer`)
        self.pending: list[tuple[int, Tensor]] = []

    def defer(self, step: int, finite: Tensor) -> None:
        """A non-factor step's verdict, left on the device until :meth:`settle`."""
        self.pending.append((step, finite))

    def settle(self) -> None:
        """Read the deferred verdicts (one host read) and report the
        non-finite ones: those steps were not skipped (nothing was read to
        skip them), so their gradients went through and they advanced the
        step counter; no statistic was folded on them (they were not
        factor steps), so no factor or decomposition saw them."""
        if not self.pending:
            return
        flags = torch.stack([ok.to(self.pending[0][1].device) for _, ok in self.pending])
        steps = [step for step, _ in self.pending]
        self.pending.clear()
        for step, ok in zip(steps, flags.tolist(), strict=True):
            if not ok:
                self.record(step, deferred=True)

    def record(self, step: int, deferred: bool = False) -> None:
        self.count += 1
        if self.count & (self.count - 1):  # not a power of two
            return
        if deferred:
            warnings.warn(
                f"kaisa: {self.count} step(s) with non-finite gradients so far (the latest at "
                f"step {step}, a non-factor step whose verdict stayed on the device until the "
                "next factor step): its gradients went through and it advanced the step count; "
                "no factor or decomposition saw it. A NaN or Inf loss is the usual cause; the "
                f"next report comes at {2 * self.count}",
                stacklevel=5,
            )
            return
        warnings.warn(
            f"kaisa: skipped {self.count} step(s) with non-finite gradients so far (the latest "
            f"at step {step}): their statistics were dropped, the factors, decompositions and "
            "step count left as they were, and the gradients left unchanged. A NaN or Inf "
            f"loss is the usual cause; the next report comes at {2 * self.count} skips",
            stacklevel=5,
        )
