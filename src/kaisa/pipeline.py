"""The K-FAC step, one method per phase, in the order the data flows::

    capture (hooks, during forward/backward)      kaisa.capture
    → batch statistics, reduced to their owner    kaisa.reduction
    → running average (owners only)               kaisa.layer
    → decompose (owners only)                     kaisa.second_order, kaisa.methods
    → broadcast to the layer's gradient workers   kaisa.second_order
    → precondition (gradient workers)             kaisa.apply, kaisa.methods
    → broadcast preconditioned gradients          kaisa.apply
    → KL-clip scale, write back                   kaisa.apply, kaisa.engines

Who does what is fixed once, at construction, by the work plan
(:mod:`kaisa.plan`); :mod:`kaisa.wiring` builds the pieces this class runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from kaisa.apply import GradientApplication
from kaisa.capture import Capture
from kaisa.comm import Communicator
from kaisa.engines.base import Engine, GradientMarks
from kaisa.factors import FactorSource
from kaisa.layer import KFACLayer
from kaisa.plan import WorkPlan
from kaisa.reduction import FactorReduction
from kaisa.scaling import LossScaling
from kaisa.schedule import Schedule
from kaisa.second_order import SecondOrderUpdate

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

    def __post_init__(self) -> None:
        self.marks = GradientMarks()
        self._broadcast_reported: set[str] = set()
        self.capture.enabled = self.schedule.is_factor_step(self.steps)
        if self.in_hook and self.comm.distributed:
            self.capture.on_layer_complete = self.reduction.layer_complete

    def step(self) -> None:
        step = self.steps
        self.engine.check_step()
        self.check_new_backward()
        self.scaling.check_unscaled()
        factor_step = self.schedule.is_factor_step(step)
        if not self.gradients_valid():
            self.skip(factor_step)
            return
        damping = self.schedule.damping(step)
        if factor_step:
            self.reduce_factors(step)
        self.update_second_order(step, damping)
        self.apply(step, damping, factor_step)
        self.comm.stats.end_step()
        self.steps += 1
        self.capture.enabled = self.schedule.is_factor_step(self.steps)
        self.marks.record(self.engine.gradient_marks([la.adapter for la in self.layers]))

    # -- phases --------------------------------------------------------------------
    def check_new_backward(self) -> None:
        """Refuse to precondition the same gradients twice."""
        marks = self.engine.gradient_marks([la.adapter for la in self.layers])
        if self.marks.unchanged(marks):
            raise RuntimeError(
                "kaisa: step() was called again with no backward pass since the last step(): "
                "the gradients are already preconditioned. Call loss.backward() between "
                "step() calls (one step() per optimizer step)"
            )
        if self.steps == 0 and all(
            la.batch.calls == 0 and not la.pending.calls and m is None
            for la, m in zip(self.layers, marks)
        ):
            raise RuntimeError(
                "step() was called before any forward/backward pass was captured: call "
                "loss.backward() on a training-mode forward pass before precond.step()"
            )

    def gradients_valid(self) -> bool:
        """The grad scaler's verdict and the engine's own (DeepSpeed's fp16
        overflow), the same on every rank: one small collective when either
        has one, none otherwise."""
        found = self.scaling.found_inf()
        verdicts = [self.engine.step_is_valid(), True if found is None else found == 0]
        verdicts = [v for v in verdicts if v is not True]
        if not verdicts:
            return True
        local = all(bool(v) for v in verdicts)
        return self.comm.agree_all([local], self.layers[0].adapter.device)[0]

    def skip(self, factor_step: bool) -> None:
        """A step the optimizer will skip: leave every statistic, factor,
        decomposition and the step count as they were."""
        if factor_step:
            self.reduction.run(self.schedule.factor_decay(self.steps), fold=False)
        for layer in self.layers:
            layer.batch.reset()
            layer.pending.calls.clear()
        self.comm.stats.end_step()
        self.marks.record(self.engine.gradient_marks([la.adapter for la in self.layers]))

    def reduce_factors(self, step: int) -> None:
        """Statistics → owners → running averages."""
        self._report_dropped_forwards()
        self._report_broadcast_inputs()
        if not self.in_hook:
            for layer in self.layers:
                self.capture.flush(layer)
        self.reduction.run(self.schedule.factor_decay(step))

    def update_second_order(self, step: int, damping: float) -> None:
        """Decompose and broadcast on inverse steps; at once for a layer seen the first time."""
        every = self.stale or self.schedule.is_inverse_step(step)
        due = [la for la in self.layers if la.captured and (every or not la.decomposed)]
        self.second_order.run(due, damping)
        self.stale = False

    def apply(self, step: int, damping: float, factor_step: bool) -> None:
        self.application.run(
            self.layers,
            damping,
            self.schedule.lr(step),
            self.schedule.kl_clip(step),
            factor_step,
        )

    def _report_broadcast_inputs(self) -> None:
        """A layer that saw fewer data points per pass than the rest of the
        model was fed one row broadcast over the batch (position ids of shape
        ``[1, T]``): its G is that of the batch-summed gradient, not the
        per-example one.  Said once per layer."""
        per_pass = {}
        for la in self.layers:
            index = next(
                (i for i, s in enumerate(la.factors) if s.source is FactorSource.OUTPUT_GRAD), None
            )
            if index is not None and la.batch.passes:
                per_pass[la.name] = la.batch.counts[index] / la.batch.passes
        if not per_pass:
            return
        most = max(per_pass.values())
        for name, seen in per_pass.items():
            if seen == 1 < most and name not in self._broadcast_reported:
                self._broadcast_reported.add(name)
                warnings.warn(
                    f"kaisa: layer {name!r} saw {seen:g} data point(s) per pass where other "
                    f"layers saw {most:g}: its input is probably broadcast over the batch (e.g. "
                    "position ids of shape [1, T]), so its G factor is that of the batch-summed "
                    "gradient. Pass per-example inputs (ids.expand(N, T)) or leave it out with "
                    "skip_layers",
                    stacklevel=4,
                )

    def _report_dropped_forwards(self) -> None:
        dropped = {la.name: la.batch.pending_forwards for la in self.layers}
        dropped = {n: c for n, c in dropped.items() if c > 0}
        if dropped:
            names = ", ".join(f"{n!r} ({c})" for n, c in dropped.items())
            warnings.warn(
                f"kaisa: training-mode forward calls with no backward before step() were "
                f"ignored: {names}. Run forwards that are not followed by backward inside "
                "`with precond.paused():` (or under torch.no_grad() / model.eval())",
                stacklevel=4,
            )
