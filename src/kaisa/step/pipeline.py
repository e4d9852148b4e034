"""The K-FAC step: the phases in the order the data flows, one call each::

    guard          a backward since the last step, unscaled   kaisa.step.guard
    collect        statistics of the captured calls           kaisa.step.capture.calls
    reduce         batch statistics summed onto their owner   kaisa.step.reduce
    verdict        the step may be used (scaler, finiteness)  kaisa.step.verdict
    fold           running averages (owners only)             kaisa.step.reduce
    second order   decompose, broadcast to the workers        kaisa.step.second_order
    precondition   V, broadcast, KL clip, write back          kaisa.step.execute → apply

Who does what is fixed once, at construction, by the work plan
(:mod:`kaisa.distributed.plan`); :mod:`kaisa.wiring` builds the phases.
What one step reads — its index, damping, lr, KL clip, the verdict — is one
:class:`~kaisa.step.context.StepContext`, formed here and passed down.
"""

from __future__ import annotations

from collections.abc import Callable

from kaisa.distributed.communicator import Communicator
from kaisa.engines.base import Engine, OwnsTheLoop
from kaisa.layers.state import KFACLayer
from kaisa.methods.capabilities import updates_state
from kaisa.step.apply import GradientApplication
from kaisa.step.capture.calls import Capture
from kaisa.step.context import StepContext
from kaisa.step.execute import EagerSteps, ReplayedSteps, lr_operand
from kaisa.step.graphed import GraphedApplication
from kaisa.step.guard import StepGuard
from kaisa.step.loss_scaling import LossScaling
from kaisa.step.profile import (
    APPLY,
    DECOMPOSE,
    DETACHED,
    FACTOR,
    FOLD,
    NON_FACTOR,
    REDUCE,
    REPLAYED,
    SKIPPED,
    StepProfile,
)
from kaisa.step.reduce import FactorReduction
from kaisa.step.reports import StepReports
from kaisa.step.schedule import Schedule
from kaisa.step.second_order import SecondOrderUpdate
from kaisa.step.verdict import StepVerdict

__all__ = ["StepPipeline"]


class StepPipeline:
    """Runs ``step()``; holds the step counter and nothing the phases own."""

    def __init__(
        self,
        layers: list[KFACLayer],
        comm: Communicator,
        engine: Engine,
        capture: Capture,
        schedule: Schedule,
        reduction: FactorReduction,
        second_order: SecondOrderUpdate,
        application: GradientApplication,
        in_hook: bool,
        scaling: LossScaling,
    ) -> None:
        self.layers = layers
        self.comm = comm
        self.engine = engine
        self.capture = capture
        self.schedule = schedule
        self.reduction = reduction
        self.second_order = second_order
        self.application = application
        self.in_hook = in_hook
        self.scaling = scaling
        self.steps = 0
        #: calls of :meth:`step`, skipped ones included (what a skip report names)
        self.calls = 0
        #: runs on every rank at each inverse update (the checkpoint mirror)
        self.on_inverse_step: Callable[[int], None] | None = None
        self.guard = StepGuard(layers, engine, scaling, capture.graph)
        self.reports = StepReports()
        may_defer = not (
            updates_state(application.method)
            or comm.model_parallel
            or (comm.distributed and not engine.gradients_agree())
        )
        self.verdict = StepVerdict(layers, comm, engine, scaling, may_defer, application.reads_free)
        self.executor: EagerSteps | ReplayedSteps = EagerSteps(application, self.verdict)
        self.capture.begin_step(0, schedule.is_factor_step(0))
        self._profile: StepProfile | None = None
        if in_hook and comm.distributed:
            capture.on_layer_complete = reduction.layer_complete

    @property
    def graphed(self) -> GraphedApplication | None:
        """Non-factor steps replayed as a CUDA graph (``precond.compile``); None: eager."""
        return self.executor.graphed if isinstance(self.executor, ReplayedSteps) else None

    @graphed.setter
    def graphed(self, value: GraphedApplication | None) -> None:
        eager = EagerSteps(self.application, self.verdict)
        arms = self.scaling.scaler is None and not isinstance(self.engine, OwnsTheLoop)
        self.executor = (
            eager
            if value is None
            else ReplayedSteps(value, eager, self.schedule, self.second_order, arms)
        )

    @property
    def profile(self) -> StepProfile | None:
        return self._profile

    @profile.setter
    def profile(self, value: StepProfile | None) -> None:
        """Attach (or detach) a profile to every phase that times itself."""
        self._profile = value
        for phase in (self.capture, self.reduction, self.second_order, self.application):
            phase.profile = value

    def step(self) -> bool:
        """One step; False where it was skipped (a scaler's skip, or non-finite gradients)."""
        clock = self._profile or DETACHED  # the phases' boundaries (no-ops while detached)
        started = clock.start()
        step = self.steps
        self.calls += 1
        self.guard.check(first=step == 0)
        since = clock.start()
        if self.executor.settled(self.layers, step):
            clock.stop(APPLY, since)
            self._end_step(True)
            clock.end_step(REPLAYED, started)
            return True
        factor_step = self.schedule.is_factor_step(step)
        # the reductions backward started come first: any other collective
        # (the validity verdict) issued before them would cross them
        counts = None
        if factor_step:
            since = clock.start()
            counts = self._collect()
            clock.stop(REDUCE, since)
        verdict = self.verdict.judge(factor_step, self.calls)
        if not verdict.valid:
            self.skip(counts is not None)
            clock.end_step(SKIPPED, started)
            return False
        # every schedule value this step reads, before anything changes: a
        # callable refused here (a bad value at this step) leaves the factors
        # and decompositions as they were
        damping = self.schedule.damping(step)
        decay = self.schedule.factor_decay(step) if counts is not None else None
        inverse_step = self.schedule.is_inverse_step(step)
        lr = lr_operand(self.schedule, self.application, step)
        kl_clip = self.schedule.kl_clip(step)
        if counts is not None and decay is not None:
            since = clock.start()
            if self.reduction.fold(counts, decay):
                self.second_order.settled = False  # layers may be captured for the first time
            clock.stop(FOLD, since)
        since = clock.start()
        self.second_order.update(self.layers, inverse_step, damping)
        if inverse_step and self.on_inverse_step is not None:
            self.on_inverse_step(step)
        since = clock.stop(DECOMPOSE, since)
        ctx = StepContext(
            step, factor_step, damping, lr, kl_clip, verdict.presence, verdict.verdict_of
        )
        replayed = self.executor.run(self.layers, ctx, verdict.deferred)
        clock.stop(APPLY, since)
        self._end_step(replayed)
        clock.end_step(REPLAYED if replayed else FACTOR if factor_step else NON_FACTOR, started)
        return True

    def _collect(self) -> list[float]:
        """Statistics → owners; the counts of every factor, summed over the
        ranks (folded into the running averages once the step is known to
        be valid)."""
        self.capture.collect_compiled()
        self.reports.dropped_forwards(self.layers)
        self.reports.broadcast_inputs(self.layers)
        self.reports.eval_forwards(self.layers, self.engine)
        self.reports.changed_biases(self.layers)
        self.reports.replaced_modules(self.layers, self.capture.root)
        capture = self.capture
        if not self.in_hook:
            for layer in self.layers:
                capture.flush(layer)
        self.reports.extra_passes(  # the passes are counted once the calls are committed
            self.layers, capture.accumulation_steps, capture.normalisation.loss_average
        )
        return self.reduction.exchange()

    def _end_step(self, replayed: bool) -> None:
        """Count the step; mark the gradients it leaves (a replay's own stamp
        where it replayed: no mark per layer)."""
        self.comm.stats.end_step()
        self.reduction.end_step()
        self.steps += 1
        self.capture.begin_step(self.steps, self.schedule.is_factor_step(self.steps))
        self.guard.mark(self.executor.stamp() if replayed else None)

    def skip(self, reduced: bool) -> None:
        """A step the scaler skips, or whose gradients are not finite: leave
        every factor, decomposition, gradient and the step count as they
        were, and drop the step's statistics (``reduced``: already summed
        over the ranks)."""
        if reduced:
            self.reduction.discard()
        self.reduction.end_step()
        for layer in self.layers:
            layer.batch.reset()
            layer.pending.calls.clear()
        self.comm.stats.end_step()
        self.guard.mark()

    def resume_at(self, steps: int) -> None:
        """Continue from a checkpoint taken after ``steps`` steps (its layers
        loaded: captured and decomposed as they were)."""
        self.steps = steps
        self.second_order.settled = False
        self.capture.begin_step(steps, self.schedule.is_factor_step(steps))
