"""The K-FAC step, one method per phase, in the order the data flows::

    capture (hooks, during forward/backward)      kaisa.step.capture.calls
    → batch statistics, reduced to their owner    kaisa.step.reduce
    → running average (owners only)               kaisa.layers.state
    → decompose (owners only)                     kaisa.step.second_order, kaisa.methods
    → broadcast to the layer's gradient workers   kaisa.step.second_order
    → precondition (gradient workers)             kaisa.step.apply, kaisa.methods
    → broadcast preconditioned gradients          kaisa.step.apply
    → KL-clip scale, write back                   kaisa.step.apply, kaisa.engines

Who does what is fixed once, at construction, by the work plan
(:mod:`kaisa.distributed.plan`); :mod:`kaisa.wiring` builds the pieces this class runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from kaisa.distributed.communicator import Communicator
from kaisa.distributed.plan import WorkPlan
from kaisa.engines.base import Engine, GradientMarks, OwnsTheLoop
from kaisa.layers.state import KFACLayer
from kaisa.step.apply import GradientApplication
from kaisa.step.capture.calls import Capture
from kaisa.step.graphed import GraphedApplication
from kaisa.step.loss_scaling import LossScaling
from kaisa.step.nonfinite import NonFiniteSteps, finite_verdict, gradients_finite
from kaisa.step.profile import (
    APPLY,
    DECOMPOSE,
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
from kaisa.step.schedule import FixedValues, Schedule
from kaisa.step.second_order import SecondOrderUpdate

__all__ = ["StepPipeline"]


@dataclass
class StepPipeline:
    """Runs ``step()``; holds the step counter and nothing the phases own."""

    layers: list[KFACLayer]
    plan: WorkPlan
    comm: Communicator
    engine: Engine
    capture: Capture
    schedule: Schedule
    reduction: FactorReduction
    second_order: SecondOrderUpdate
    application: GradientApplication
    in_hook: bool
    scaling: LossScaling
    steps: int = 0
    #: the second-order tensors must be recomputed at the next step (after a load)
    stale: bool = False
    #: the statistics captured since the last step are not folded (``reset_batch()``)
    drop_statistics: bool = False
    #: runs on every rank at each inverse update (the checkpoint mirror, kaisa.checkpoint.mirror)
    on_inverse_step: Callable[[int], None] | None = None
    #: non-factor steps' application replayed as a CUDA graph (kaisa.step.graphed)
    graphed: GraphedApplication | None = None

    def __post_init__(self) -> None:
        self.marks = GradientMarks()
        #: the layers' adapters (read every step: a list made once)
        self.adapters = [la.adapter for la in self.layers]
        #: every captured layer is decomposed (as of the last look; a factor
        #: step, an inverse step or a load looks again)
        self._settled = False
        #: the engine, where it has a step boundary of its own to check (asked once)
        self._loop = self.engine if isinstance(self.engine, OwnsTheLoop) else None
        self.nonfinite = NonFiniteSteps()
        #: calls of :meth:`step`, skipped ones included (what a skip report names)
        self.calls = 0
        #: whether the last call skipped its step for non-finite gradients
        self.skipped_nonfinite = False
        #: each layer's gradient presence, agreed on with the finiteness check
        self._presence: dict[str, bool] | None = None
        #: a non-factor step's finiteness verdict is formed on the device (defer_verdict)
        self._verdict_owed = False
        self.reports = StepReports()
        #: the schedule's constants, once a non-factor step was replayed (_replay_settled)
        self._fast: FixedValues | None = None
        self._fast_scalars: bool | None = None
        #: non-factor steps that took :meth:`_replay_settled`
        self.shortcuts = 0
        #: what of defer_verdict's conditions is fixed at construction
        self._may_defer = not (
            self.application.method.apply_updates_state
            or self.comm.model_parallel
            or (self.comm.distributed and not self.engine.gradients_agree())
        )
        self.capture.enabled = self.schedule.is_factor_step(self.steps)
        #: the phases' wall times, while attached (:mod:`kaisa.step.profile`)
        self._profile: StepProfile | None = None
        if self.in_hook and self.comm.distributed:
            self.capture.on_layer_complete = self.reduction.layer_complete

    @property
    def profile(self) -> StepProfile | None:
        return self._profile

    @profile.setter
    def profile(self, value: StepProfile | None) -> None:
        """Attach (or detach) a profile to every part that times a phase."""
        self._profile = value
        self.capture.profile = value
        self.reduction.profile = value
        self.second_order.profile = value
        self.application.profile = value

    def step(self) -> bool:
        """One step; False where it was skipped (a scaler's skip, or non-finite gradients)."""
        profile = self._profile  # a boundary below costs one test of it while detached
        started = profile.start() if profile is not None else 0.0
        step = self.steps
        self.calls += 1
        self.skipped_nonfinite = False
        if self._loop is not None:
            self._loop.check_step()
        self.check_new_backward()
        self.scaling.check_unscaled()
        if self._fast is not None and self._replay_settled(step, self._fast):
            self._end_step((step + 1) % self._fast.factor_every == 0, True)
            if profile is not None:
                profile.end_step(REPLAYED, started)
            return True
        factor_step = self.schedule.is_factor_step(step)
        # the reductions backward started come first: any other collective
        # (the validity verdict) issued before them would cross them
        counts = None
        if factor_step:
            since = profile.start() if profile is not None else 0.0
            counts = self.reduce_factors()
            if profile is not None:
                profile.stop(REDUCE, since)
        deferred = not factor_step and self.defer_verdict()
        if not deferred:
            self.nonfinite.settle()
            if not self.gradients_valid():
                self.skip(counts is not None)
                if profile is not None:
                    profile.end_step(SKIPPED, started)
                return False
        if counts is not None and self.drop_statistics:
            self.reduction.discard()
            counts = None
        self.drop_statistics = False
        damping = self.schedule.damping(step)
        if counts is not None:
            since = profile.start() if profile is not None else 0.0
            self.reduction.fold(counts, self.schedule.factor_decay(step))
            if profile is not None:
                profile.stop(FOLD, since)
            self._settled = False  # layers may be captured for the first time
        since = profile.start() if profile is not None else 0.0
        self.update_second_order(step, damping)
        if profile is not None:
            since = profile.stop(DECOMPOSE, since)
        replayed = self.apply(step, damping, factor_step, deferred)
        if profile is not None:
            profile.stop(APPLY, since)
        self._end_step(self.schedule.is_factor_step(step + 1), replayed)
        if profile is not None:
            path = REPLAYED if replayed else FACTOR if factor_step else NON_FACTOR
            profile.end_step(path, started)
        return True

    def _end_step(self, factor_next: bool, replayed: bool) -> None:
        """Count the step; mark the gradients it leaves (a replay's own stamp
        where it replayed: no mark per layer)."""
        self.comm.stats.end_step()
        self.steps += 1
        self.capture.enabled = factor_next
        stamp = self.graphed.stamp() if replayed and self.graphed is not None else None
        if stamp is not None:
            self.marks.stamp(stamp)
        else:
            self.marks.record(self.engine.gradient_marks(self.adapters))

    def _replay_settled(self, step: int, fixed: FixedValues) -> bool:
        """A replayed non-factor step after another, with only what may have
        changed since checked (on a GPU this Python is the step's cost): the
        schedule (its revision: a changed value goes the whole way), the
        step's place in it, new layers or a load (:attr:`_settled`,
        :attr:`stale`) and the scalars' rule.  What :meth:`defer_verdict`
        and :meth:`update_second_order` would conclude holds while these
        do; the replay checks the gradients (:meth:`GraphedApplication.run`).
        False where it did not replay: the step goes the whole way."""
        graphed = self.graphed
        if (
            graphed is None
            or fixed.revision != self.schedule.revision
            or step % fixed.factor_every == 0
            or step % fixed.inverse_every == 0
            or self.stale
            or not self._settled
            or self.application.read_scalars is not self._fast_scalars
        ):
            return False  # a full step (it arms this again with what it finds)
        self._presence = None
        self._verdict_owed = True
        lr = fixed.lr if fixed.lr is not None else self.lr_operand(step)
        profile = self._profile
        since = profile.start() if profile is not None else 0.0
        replayed, tally = graphed.run(
            self.layers, fixed.damping, lr, fixed.kl_clip, self._verdict, step
        )
        if profile is not None:
            profile.stop(APPLY, since)
        if not replayed:
            return False
        if tally is not None:
            self.nonfinite.defer_tally(tally)
        self.drop_statistics = False
        self.shortcuts += 1
        return True

    def resume_at(self, steps: int) -> None:
        """Continue from a checkpoint taken after ``steps`` steps (its layers
        loaded: captured and decomposed as they were)."""
        self.steps = steps
        self._settled = False
        self.capture.enabled = self.schedule.is_factor_step(steps)

    # -- phases --------------------------------------------------------------------
    def check_new_backward(self) -> None:
        """Refuse to precondition the same gradients twice."""
        adapters = self.adapters
        if self.marks.unchanged(self.engine.gradient_marks(adapters)):
            raise RuntimeError(
                "kaisa: step() was called again with no backward pass since the last step(): "
                "the gradients are already preconditioned. Call loss.backward() between "
                "step() calls (one step() per optimizer step)"
            )
        if self.steps == 0 and all(
            la.batch.calls == 0 and not la.pending.calls and m is None
            for la, m in zip(self.layers, self.engine.gradient_marks(adapters))
        ):
            raise RuntimeError(
                "step() was called before any forward/backward pass was captured: call "
                "loss.backward() on a training-mode forward pass before precond.step()"
            )

    def gradients_valid(self) -> bool:
        """The grad scaler's verdict and the engine's own (DeepSpeed's fp16
        overflow), the same on every rank: one small collective when either
        has one.  Without either, kaisa checks the gradients itself
        (:meth:`gradients_finite`)."""
        self._presence = None
        engine_verdict = self.engine.step_is_valid()
        found = self.scaling.found_inf()
        if found is None and engine_verdict is True:
            return self.gradients_finite()
        verdicts = [engine_verdict, True if found is None else found == 0]
        verdicts = [v for v in verdicts if v is not True]
        local = all(bool(v) for v in verdicts)
        return self.comm.agree_all([local], self.layers[0].adapter.device)[0]

    def defer_verdict(self) -> bool:
        """Leave this non-factor step's finiteness verdict on the device
        (:mod:`kaisa.step.nonfinite`) instead of reading it: where a read is
        not free, the method changes no state while applying, and the
        verdict needs no collective (one process, or gradients the engine
        has already averaged).  True if deferred (the verdict is then formed
        by :meth:`apply`)."""
        if (
            not self._may_defer
            or self.application.reads_free(self.adapters[0].device)
            or self.engine.step_is_valid() is not True
        ):
            return False
        self._presence = None
        # formed in apply(), before the gradients change (inside a replayed
        # step's graph there); a scaler's skips are its own, as before
        self._verdict_owed = self.scaling.found_inf() is None
        return True

    def _verdict(self) -> Tensor | None:
        """The deferred finiteness verdict of this step's gradients (on the device)."""
        return finite_verdict(self.engine.local_gradients(self.adapters))

    def gradients_finite(self) -> bool:
        """Whether every registered layer's gradient is finite on every rank
        (:mod:`kaisa.step.nonfinite`).  Where DDP has averaged the gradients a NaN on
        one rank is a NaN on all, so each rank's own check is the verdict;
        elsewhere it travels with the layers' gradient presence in the one
        collective the gradient application would run anyway, and over the
        model-parallel groups, whose ranks must skip together."""
        adapters = self.adapters
        device = adapters[0].device
        finite = gradients_finite(self.engine.local_gradients(adapters))
        if self.comm.distributed and not self.engine.gradients_agree():
            present = [self.engine.present(a) for a in adapters]
            agreed = self.comm.agree_all([finite, *present], device)
            finite = agreed[0]
            self._presence = {la.name: ok for la, ok in zip(self.layers, agreed[1:])}
        finite = self.comm.agree_model_parallel(finite, device)
        if not finite:
            self.skipped_nonfinite = True
            self.nonfinite.record(self.calls)
        return finite

    def skip(self, reduced: bool) -> None:
        """A step the scaler skips, or whose gradients are not finite: leave
        every factor, decomposition, gradient and the step count as they
        were, and drop the step's statistics (``reduced``: already summed
        over the ranks)."""
        if reduced:
            self.reduction.discard()
        self.drop_statistics = False
        for layer in self.layers:
            layer.batch.reset()
            layer.pending.calls.clear()
        self.comm.stats.end_step()
        self.marks.record(self.engine.gradient_marks(self.adapters))

    def reduce_factors(self) -> list[float]:
        """Statistics → owners; the counts of every factor, summed over the
        ranks (folded into the running averages once the step is known to
        be valid)."""
        self.capture.collect_compiled()
        self.reports.dropped_forwards(self.layers)
        self.reports.broadcast_inputs(self.layers)
        self.reports.eval_forwards(self.layers, self.engine)
        if not self.in_hook:
            for layer in self.layers:
                self.capture.flush(layer)
        return self.reduction.exchange()

    def update_second_order(self, step: int, damping: float) -> None:
        """Decompose and broadcast on inverse steps; at once for a layer seen the first time."""
        inverse_step = self.schedule.is_inverse_step(step)
        every = self.stale or inverse_step
        if every or not self._settled:
            due = [la for la in self.layers if la.captured and (every or not la.decomposed)]
            self.second_order.run(due, damping)
            self._settled = all(la.decomposed for la in self.layers if la.captured)
        self.stale = False
        if inverse_step and self.on_inverse_step is not None:
            self.on_inverse_step(step)

    def lr_operand(self, step: int) -> float | Tensor:
        """The learning rate the KL clip reads: an optimizer's tensor one stays
        on its device unless reading it is free."""
        lr = self.schedule.lr_operand(step)
        if isinstance(lr, Tensor) and self.application.reads_free(lr.device):
            return float(lr)
        return lr

    def apply(self, step: int, damping: float, factor_step: bool, deferred: bool) -> bool:
        """``deferred``: a non-factor step whose verdict stays on the device,
        which may be replayed (:mod:`kaisa.step.graphed`); once one is, the
        next ones may take :meth:`_replay_settled`.  Returns whether it replayed."""
        lr, kl_clip = self.lr_operand(step), self.schedule.kl_clip(step)
        verdict_of = self._verdict if deferred and self._verdict_owed else None
        graphed = self.graphed
        if deferred and graphed is not None:
            replayed, tally = graphed.run(self.layers, damping, lr, kl_clip, verdict_of, self.steps)
            if replayed:
                if tally is not None:
                    self.nonfinite.defer_tally(tally)
                if self.scaling.scaler is None and self._loop is None:
                    self._fast = self.schedule.fixed()
                    self._fast_scalars = self.application.read_scalars
                return True
        verdict = verdict_of() if verdict_of is not None else None
        self.application.run(self.layers, damping, lr, kl_clip, factor_step, self._presence)
        if verdict is not None:
            self.nonfinite.defer(self.steps, verdict)
        return False
