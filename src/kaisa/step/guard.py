"""What a ``step()`` call must find before anything changes: a backward pass
since the last step (never the same gradients preconditioned twice), a
forward pass captured before the first step, no compiled forward on a torch
whose ``torch.compile`` kaisa does not support (:mod:`kaisa.torch_support`),
the engine's own step boundary (DeepSpeed, pipelining) and a
``GradScaler``'s gradients unscaled.

The gradients a step leaves are marked (:class:`~kaisa.engines.base.GradientMarks`:
one mark per layer, or a replay's own stamp, which costs nothing per layer),
so the next call can tell whether a backward has run since.
"""

from __future__ import annotations

from kaisa.engines.base import Engine, GradientMarks, MarksStamp, OwnsTheLoop
from kaisa.layers.state import KFACLayer
from kaisa.step.capture.graph import GraphCapture
from kaisa.step.loss_scaling import LossScaling
from kaisa.torch_support import compile_refusal

__all__ = ["StepGuard"]


class StepGuard:
    """Refuses a ``step()`` call that would precondition nothing or the same gradients again."""

    def __init__(
        self, layers: list[KFACLayer], engine: Engine, scaling: LossScaling, graph: GraphCapture
    ) -> None:
        self.layers = layers
        self.graph = graph
        self.adapters = [la.adapter for la in layers]
        self.engine = engine
        self.scaling = scaling
        self.marks = GradientMarks()
        #: the engine, where it has a step boundary of its own to check (asked once)
        self.loop = engine if isinstance(engine, OwnsTheLoop) else None

    def check(self, first: bool) -> None:
        """Before a step (``first``: no step taken yet)."""
        if self.graph.refused:
            raise RuntimeError(compile_refusal("a model compiled with torch.compile"))
        if self.loop is not None:
            self.loop.check_step()
        marks = self.engine.gradient_marks(self.adapters)
        if self.marks.unchanged(marks):
            raise RuntimeError(
                "kaisa: step() was called again with no backward pass since the last step(): "
                "the gradients are already preconditioned. Call loss.backward() between "
                "step() calls (one step() per optimizer step)"
            )
        frozen = all(not la.adapter.weight.requires_grad for la in self.layers)
        if (first and not frozen) and all(  # every weight frozen: gradual unfreezing's start
            la.batch.calls == 0 and not la.pending.calls and m is None
            for la, m in zip(self.layers, self.engine.gradient_marks(self.adapters))
        ):
            raise RuntimeError(
                "step() was called before any forward/backward pass was captured: call "
                "loss.backward() on a training-mode forward pass before precond.step()"
            )
        self.scaling.check_unscaled()

    def mark(self, stamp: MarksStamp | None = None) -> None:
        """The gradients as this step leaves them (a replay's ``stamp``, else a mark per layer)."""
        if stamp is not None:
            self.marks.stamp(stamp)
        else:
            self.marks.record(self.engine.gradient_marks(self.adapters))
