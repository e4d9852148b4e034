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
step synchronises anyway.  Such a step is not skipped by kaisa — it changes
no factor or decomposition either way — but it is counted and reported, and
an optimizer that reads a ``found_inf`` tensor skips its update on the
device (:mod:`kaisa.step.skip`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kaisa.step.skip import LEFT
from kaisa.warn import warn_user

__all__ = ["NonFiniteSteps", "VerdictTally", "finite_verdict", "gradients_finite"]


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


class VerdictTally:
    """Deferred verdicts kept on the device without a tensor per step.

    A replayed step (:mod:`kaisa.step.graphed`) forms its verdict inside a
    CUDA graph, in a tensor the next replay overwrites: keeping it would
    cost a copy — a launch — every step.  Instead the graph adds it here
    (:meth:`add`, in-place operations recorded with the step): how many
    steps were counted, how many were not finite, and the ordinals of the
    first and the latest that were not.  The host keeps which step each
    ordinal was (:attr:`steps`), so :meth:`NonFiniteSteps.settle` reports
    the count, and the steps as far as the reports name them, as it does
    from per-step verdicts."""

    def __init__(self, device: torch.device) -> None:
        #: counted, not finite, the first and the latest not finite (ordinals from 1)
        self.values = torch.zeros(4, dtype=torch.int64, device=device)
        #: the step of each counted ordinal (ordinal k is ``steps[k - 1]``)
        self.steps: list[int] = []

    def add(self, finite: Tensor) -> None:
        """Count one step's verdict (device work only: it may be recorded)."""
        counted, bad, first, latest = self.values.unbind(0)
        counted.add_(1)
        bad.add_(finite.logical_not())
        first.copy_(torch.where(finite | (first > 0), first, counted))
        latest.copy_(torch.where(finite, latest, counted))

    def taken(self, values: Sequence[int]) -> list[int]:
        """The non-finite steps among those counted, given :attr:`values` as
        read — the first and the latest by their steps, any between them
        by the latest's (the reports name the latest at each count) — and
        start counting afresh."""
        _, bad, first, latest = values
        known = self.steps or [-1]  # ordinals past the list are not expected: report, not fail
        at = [known[min(max(k, 1), len(known)) - 1] for k in (first, latest)]
        steps = [at[0]] + [at[1]] * (bad - 1) if bad else []
        self.steps.clear()
        self.values.zero_()
        return steps


class NonFiniteSteps:
    """Counts the steps skipped for non-finite gradients and says so: at the
    1st, 2nd, 4th, 8th … skip, so a run that keeps producing them is told
    how many without a warning per step."""

    def __init__(self) -> None:
        self.count = 0
        #: what happens to a skipped step's update, as the report says it
        #: (:class:`kaisa.step.skip.SkippedUpdates` sets it), and that of a
        #: step whose verdict stayed on the device
        self.gradients = LEFT
        self.deferred_update = "its gradients went through"
        #: (step, verdict on device) of steps run without reading it (:meth:`defer`)
        self.pending: list[tuple[int, Tensor]] = []
        #: verdicts of replayed steps, counted on the device (:meth:`defer_tally`)
        self.tallies: list[VerdictTally] = []

    def defer(self, step: int, finite: Tensor) -> None:
        """A non-factor step's verdict, left on the device until :meth:`settle`."""
        self.pending.append((step, finite))

    def defer_tally(self, tally: VerdictTally) -> None:
        """Verdicts counted on the device (:class:`VerdictTally`), until :meth:`settle`."""
        if tally not in self.tallies:
            self.tallies.append(tally)

    def settle(self) -> None:
        """Read the deferred verdicts (one host read) and report the
        non-finite ones: those steps were not skipped (nothing was read to
        skip them), so their gradients went through and they advanced the
        step counter; no statistic was folded on them (they were not
        factor steps), so no factor or decomposition saw them."""
        tallies = [t for t in self.tallies if t.steps]
        self.tallies.clear()
        if not self.pending and not tallies:
            return
        device = (self.pending[0][1] if self.pending else tallies[0].values).device
        parts = [t.values.to(device) for t in tallies]
        if self.pending:
            verdicts = torch.stack([ok.to(device) for _, ok in self.pending])
            parts.insert(0, verdicts.to(torch.int64))
        read = torch.cat(parts).tolist()
        at = len(self.pending)
        bad = [step for (step, _), ok in zip(self.pending, read[:at], strict=True) if not ok]
        self.pending.clear()
        for tally in tallies:
            bad += tally.taken(read[at : at + 4])
            at += 4
        for step in sorted(bad):
            self.record(step, deferred=True)

    def record(self, step: int, deferred: bool = False) -> None:
        self.count += 1
        if self.count & (self.count - 1):  # not a power of two
            return
        if deferred:
            warn_user(
                f"kaisa: {self.count} step(s) with non-finite gradients so far (the latest at "
                f"step {step}, a non-factor step whose verdict stayed on the device until the "
                f"next factor step): {self.deferred_update}; it advanced the step count, and "
                "no factor or decomposition saw it. A NaN or Inf loss is the usual cause; the "
                f"next report comes at {2 * self.count}",
            )
            return
        warn_user(
            f"kaisa: skipped {self.count} step(s) with non-finite gradients so far (the latest "
            f"at call {step} of step()): their statistics were dropped, the factors, "
            f"decompositions and step count left as they were, and {self.gradients}. A NaN "
            f"or Inf loss is the usual cause; the next report comes at {2 * self.count} skips",
        )
