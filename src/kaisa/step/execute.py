"""How a step's preconditioning runs: eagerly, or replayed as a recorded graph.

:class:`EagerSteps` runs the gradient application
(:mod:`kaisa.step.apply`: per layer, in place, stacked), forming a deferred
finiteness verdict first, before the gradients change.  :class:`ReplayedSteps`
wraps one: a non-factor step whose verdict stays on the device is replayed
(:mod:`kaisa.step.graphed`), anything else goes to the eager one; once a step
replayed, the next non-factor steps may take the settled path, which checks
only what may have changed since (on a GPU this Python is the step's cost).
"""

from __future__ import annotations

from torch import Tensor

from kaisa.layers.state import KFACLayer
from kaisa.step.apply import GradientApplication
from kaisa.step.context import StepContext
from kaisa.step.graphed import GraphedApplication
from kaisa.step.recording import ReplayStamp
from kaisa.step.schedule import FixedValues, Schedule
from kaisa.step.second_order import SecondOrderUpdate
from kaisa.step.verdict import StepVerdict

__all__ = ["EagerSteps", "ReplayedSteps"]


class EagerSteps:
    """The application run as it is (no recording)."""

    #: non-factor steps that took the settled path (none here)
    shortcuts = 0

    def __init__(self, application: GradientApplication, verdict: StepVerdict) -> None:
        self.application = application
        self.verdict = verdict

    def run(self, layers: list[KFACLayer], ctx: StepContext, deferred: bool) -> bool:
        """Precondition and write back; returns whether it replayed (never here)."""
        found = ctx.verdict_of() if ctx.verdict_of is not None else None
        self.application.run(layers, ctx)
        if found is not None:
            self.verdict.nonfinite.defer(ctx.step, found)
        return False

    def settled(self, layers: list[KFACLayer], step: int) -> bool:
        """The settled path (replays only): False, the step goes the whole way."""
        return False

    def stamp(self) -> ReplayStamp | None:
        """The gradients as the last replay left them (None: no replay)."""
        return None


class ReplayedSteps:
    """Replays ``graphed`` where it can, else runs ``eager``.

    Args:
        graphed: the recorded application.
        eager: what runs where a step cannot be replayed.
        schedule: the step's options (their revision, the step's place).
        second_order: whether every layer is decomposed and none is stale.
        arms: whether a replay may arm the settled path (no ``GradScaler``,
            no engine that owns the loop).
    """

    def __init__(
        self,
        graphed: GraphedApplication,
        eager: EagerSteps,
        schedule: Schedule,
        second_order: SecondOrderUpdate,
        arms: bool,
    ) -> None:
        self.graphed = graphed
        self.eager = eager
        self.verdict = eager.verdict
        self.schedule = schedule
        self.second_order = second_order
        self.arms = arms
        #: the schedule's constants, once a non-factor step was replayed
        self._fixed: FixedValues | None = None
        self._fixed_scalars: bool | None = None
        #: non-factor steps that took :meth:`settled`
        self.shortcuts = 0

    def run(self, layers: list[KFACLayer], ctx: StepContext, deferred: bool) -> bool:
        """``deferred``: the step's verdict stays on the device, so it may be replayed."""
        if deferred:
            replayed, tally = self.graphed.run(layers, ctx)
            if replayed:
                if tally is not None:
                    self.verdict.nonfinite.defer_tally(tally)
                if self.arms:
                    self._fixed = self.schedule.fixed()
                    self._fixed_scalars = self.eager.application.read_scalars
                return True
        return self.eager.run(layers, ctx, deferred)

    def settled(self, layers: list[KFACLayer], step: int) -> bool:
        """A replayed non-factor step after another, with only what may have
        changed since checked: the schedule (its revision: a changed value
        goes the whole way), the step's place in it, new layers or a load
        (the second-order phase's ``settled`` and ``stale``) and the
        scalars' rule.  What the verdict and the second-order phase would
        conclude holds while these do; the replay checks the gradients
        (:meth:`GraphedApplication.run`).  False where it did not replay:
        the step goes the whole way (and arms this again)."""
        fixed = self._fixed
        if (
            fixed is None
            or fixed.revision != self.schedule.revision
            or step % fixed.factor_every == 0
            or step % fixed.inverse_every == 0
            or self.second_order.stale
            or not self.second_order.settled
            or self.eager.application.read_scalars is not self._fixed_scalars
        ):
            return False
        self.verdict.skipped_nonfinite = False
        lr: float | Tensor = (
            fixed.lr
            if fixed.lr is not None
            else lr_operand(self.schedule, self.eager.application, step)
        )
        ctx = StepContext(
            step, False, fixed.damping, lr, fixed.kl_clip, verdict_of=self.verdict.on_device
        )
        replayed, tally = self.graphed.run(layers, ctx)
        if not replayed:
            return False
        if tally is not None:
            self.verdict.nonfinite.defer_tally(tally)
        self.shortcuts += 1
        return True

    def stamp(self) -> ReplayStamp | None:
        return self.graphed.stamp()


def lr_operand(schedule: Schedule, application: GradientApplication, step: int) -> float | Tensor:
    """The learning rate the KL clip reads: an optimizer's tensor one stays
    on its device unless reading it is free."""
    lr = schedule.lr_operand(step)
    if isinstance(lr, Tensor) and application.reads_free(lr.device):
        return float(lr)
    return lr
