"""A non-factor step's gradient application, recorded once and replayed.

On a GPU a non-factor step is bound by kernel launches, not by arithmetic:
measured on an H200, the 784-512-512-10 MLP's step launched 28 kernels
(reads, products, divisions, KL terms, writes) that took 1.1 ms of host time
beside a first-order step of 1.25 ms.  Yet that work is the same on every
non-factor step: the same layers, operands that change only when they are
decomposed again, and three numbers (damping, lr, kl_clip).  So it is
recorded once as a CUDA graph and replayed — a handful of launches in all
(``precond.compile(mode='reduce-overhead')`` on CUDA).

What may differ between replays, and how each is kept right:

* **the gradients**: a new tensor per backward under
  ``zero_grad(set_to_none=True)``.  The graph reads and writes the tensors
  it was recorded on (held here); new ones are copied in before a replay
  (one multi-tensor copy), and the held tensors, holding the result, then
  become the parameters' ``.grad`` (the same shape, dtype and values a copy
  back would give, without its launch).  Under ``zero_grad(set_to_none=False)``
  backward then accumulates into them and a replay copies nothing.
* **damping, lr, kl_clip**: 0-d device tensors the graph reads, refilled
  when a value changes (a schedule costs one fill, not a new recording; an
  optimizer's tensor learning rate is copied in every step, unread).
* **the operands** (eigenbases, inverses, stacked groups): new at every
  decomposition or load.  Each layer's second-order state counts such
  changes (:attr:`kaisa.layers.state.SecondOrderState.generation`), and the
  stacking switch its own (:attr:`kaisa.step.batched.ShapeGroups.revision`):
  a replay compares them with the recording's, and where one moved the
  step records anew (once per inverse update).  Nobody has to tell the
  graph that its operands changed.
* **which layers take part** (which have a gradient): part of the key; a
  new set records anew.

A recording step runs its work eagerly first (on a side stream, as CUDA
graphs want: that also builds every cache, the workspace and the stacked
operands, outside the recording), then records it without running it.
Should the recording fail (an operation a graph cannot hold), the step is
complete all the same — the eager run did its work — and every later step
runs eagerly, with one warning.  Memory: the graph keeps its intermediates
(about one ``V`` per layer) and, under ``set_to_none=True``, one set of
gradient-sized tensors beside the ones backward creates.

Only the plain path is recorded: gradients in ``param.grad``
(:class:`~kaisa.engines.pytorch.TorchEngine`), no collective in the step
(one process, or DDP with every rank every layer's worker), no model
parallelism, every layer decomposed, no diagnostics; elsewhere the step
runs as before.  The gradients' finiteness verdict, which the pipeline
defers on the device on such a step, is formed inside the graph too, before
the gradients are overwritten, and counted there
(:class:`~kaisa.step.nonfinite.VerdictTally`): a replay launches no copy of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from kaisa.engines.base import ReplayableGradients, unique_parameters
from kaisa.layers.state import KFACLayer
from kaisa.step.apply import GradientApplication
from kaisa.step.context import StepContext
from kaisa.step.nonfinite import VerdictTally
from kaisa.step.recording import (
    CUDA_GRAPH_MODES,
    NO_KEY,
    CudaGraphRecorder,
    Key,
    Recorder,
    RecordingError,
    ReplayStamp,
)
from kaisa.warn import warn_user

__all__ = [
    "CUDA_GRAPH_MODES",
    "CudaGraphRecorder",
    "GraphedApplication",
    "Recorder",
    "RecordingError",
]


class GraphedApplication:
    """Runs :meth:`GradientApplication.run` of a non-factor step as a replay.

    Args:
        application: the step's gradient application (what is recorded).
        recorder: makes a :class:`Recorder` per recording (default: CUDA graphs).
    """

    def __init__(
        self,
        application: GradientApplication,
        recorder: Callable[[], Recorder] = CudaGraphRecorder,
    ) -> None:
        self.application = application
        self._new_recorder = recorder
        self._recorder: Recorder | None = None
        self._key: Key = NO_KEY
        #: the gradient tensors the graph reads and writes
        self._grads: list[Tensor] = []
        #: damping, lr, kl_clip as the graph reads them
        self._scalars: Tensor | None = None
        self._values: list[float | None] = [None, None, None]
        #: the deferred finiteness verdicts, counted inside the graph
        self.tally: VerdictTally | None = None
        #: recordings made (each inverse update, each new set of layers)
        self.recordings = 0
        #: gradients copied into the graph's tensors (new tensors from backward)
        self.copied = 0
        #: a recording failed: every step runs eagerly
        self.failed = False
        self._fixed_ok: bool | None = None
        self._device: torch.device | None = None
        #: the parameters whose gradients the graph reads, each once
        self._params: list[nn.Parameter] = []
        #: the weights of the layers not recorded, and whether each had a gradient
        self._others: list[tuple[nn.Parameter, bool]] = []
        #: the operands' generations when recorded (:meth:`_generation`)
        self._recorded_at: tuple[int, int] = (-1, -1)

    def invalidate(self) -> None:
        """Drop the graph (the operands it reads were replaced)."""
        self._recorder = None
        self._key = NO_KEY
        self._recorded_at = (-1, -1)
        self._grads = []

    def eligible(self) -> bool:
        """Whether this step's application may be recorded (see the module);
        all but the diagnostics is fixed at construction, so asked once."""
        if self._fixed_ok is None:
            app = self.application
            engine, plan = app.engine, app.plan
            self._fixed_ok = (
                isinstance(engine, ReplayableGradients)
                and engine.replayable()
                and not app.comm.model_parallel
                and (
                    not app.comm.distributed
                    or (engine.gradients_agree() and plan.grad_workers == plan.world_size)
                )
            )
        return self._fixed_ok and not self.failed and self.application.diagnostics is None

    def run(self, layers: list[KFACLayer], ctx: StepContext) -> tuple[bool, VerdictTally | None]:
        """This step's application by replay (recording it first where
        needed), after ``ctx.verdict_of()`` — the gradients' finiteness
        verdict, formed inside the graph too and counted there into
        :attr:`tally` as step ``ctx.step`` (returned then: no copy of a
        per-step tensor, which would be one more launch).  Returns (False, None) where it cannot
        replay (the caller runs the step eagerly).

        The key is which layers have a gradient, and whether there is a KL
        clip and a verdict.  A replay checks it in the pass that reads the
        gradients it copies (this runs on every non-factor step, where a
        microsecond per layer is the step's cost); a layer newly captured
        comes with a decomposition, which drops the graph anyway."""
        damping, lr, kl_clip = ctx.damping, ctx.lr, ctx.kl_clip
        verdict_of, step = ctx.verdict_of, ctx.step
        if not self.eligible():
            self.invalidate()
            return False, None
        if self._recorder is not None and self._recorded_at != self._generation(layers):
            self.invalidate()  # a decomposition, a load or the stacking switch since
        if self._recorder is not None and (kl_clip is None, verdict_of is None) == self._key[1:]:
            grads = [p.grad for p in self._params]
            held = self._grads
            moved = [i for i, (g, h) in enumerate(zip(grads, held)) if g is not h]
            if self._same_layers(grads, moved):
                self._fill(damping, lr, kl_clip)
                if moved:
                    fresh = cast("list[Tensor]", [grads[i] for i in moved])
                    torch._foreach_copy_([held[i] for i in moved], fresh)
                    self.copied += len(moved)
                self._recorder.replay()
                params = self._params
                for i in moved:  # the graph's tensors, now holding V, become the gradients
                    params[i].grad = held[i]
                return True, self._counted(verdict_of is not None, step)
        key: Key = (
            tuple([la.adapter.weight.grad is not None for la in layers]),
            kl_clip is None,
            verdict_of is None,
        )
        if key == self._key:  # the same layers, but a bias without its gradient, or moved
            self.invalidate()
            return False, None
        done = self._record(layers, key, ctx)
        return done, self._counted(done and verdict_of is not None, step)

    def _generation(self, layers: list[KFACLayer]) -> tuple[int, int]:
        """What moves when the operands the graph reads are replaced: the
        layers' second-order generations (summed: each only grows) and the
        stacking switch's revision."""
        total = 0
        for layer in layers:
            total += layer.state.generation
        return total, self.application.groups.revision

    def stamp(self) -> ReplayStamp | None:
        """The gradients as the last replay (or recording) left them; None
        where there is no graph (the step ran eagerly)."""
        if self._recorder is None:
            return None
        return ReplayStamp(self._params, self._grads, [w for w, _ in self._others])

    def _same_layers(self, grads: list[Tensor | None], moved: list[int]) -> bool:
        """The recorded parameters have gradients (on the recorded device),
        and the other layers' presence is as recorded."""
        if moved and (
            any(grads[i] is None for i in moved) or grads[moved[0]].device != self._device  # type: ignore[union-attr]
        ):
            return False
        return all((w.grad is not None) is was for w, was in self._others)

    def _counted(self, counted: bool, step: int) -> VerdictTally | None:
        """The tally, where this step's verdict was added to it as ``step``."""
        if not counted:
            return None
        assert self.tally is not None
        self.tally.steps.append(step)
        return self.tally

    def _ready(self, taking: list[KFACLayer]) -> bool:
        """Every layer decomposed (a damping-only stand-in would be made,
        and kept, inside the recording)."""
        app = self.application
        return all(app.method.ready(la, app.plan.layer(la.name).colocated) for la in taking)

    def _record(self, layers: list[KFACLayer], key: Key, ctx: StepContext) -> bool:
        """Record this step's work (running it); returns whether it ran."""
        self.invalidate()
        engine = self.application.engine
        taking = [la for la in layers if la.preconditions and engine.present(la.adapter)]
        params = unique_parameters([la.adapter for la in taking])
        grads = [p.grad for p in params if p.grad is not None]
        if not grads or len(grads) != len(params) or not self._ready(taking):
            return False
        if len({g.device for g in grads}) > 1:  # one graph runs on one device
            return False
        self._on(grads[0].device)
        self._fill(ctx.damping, ctx.lr, ctx.kl_clip)
        assert self._scalars is not None and self.tally is not None
        damping_t, lr_t, kl_clip_t = self._scalars.unbind(0)
        app, tally, verdict_of = self.application, self.tally, ctx.verdict_of
        # the graph reads its operands from the tensors _fill refills
        recorded = ctx.replace(
            factor_step=False,
            damping=damping_t,
            lr=lr_t,
            kl_clip=None if ctx.kl_clip is None else kl_clip_t,
            presence=None,
        )

        def work() -> None:
            verdict = verdict_of() if verdict_of is not None else None
            if verdict is not None:
                tally.add(verdict)
            # no clock inside a recording (a graph holds no host work; a
            # synchronisation would end it): the step's profile times it whole
            profile, app.profile = app.profile, None
            try:
                app.run(layers, recorded)
            finally:
                app.profile = profile

        recorder = self._new_recorder()
        try:
            recorder.record(work)
        except RecordingError as failed:
            self.failed = True
            warn_user(
                "kaisa: the non-factor step could not be recorded as a CUDA graph "
                f"({failed.__cause__!r}); it runs eagerly from now on (the step just taken "
                "is complete). Please report it with the model",
            )
            return True
        self._recorder = recorder
        self._key = key
        self._recorded_at = self._generation(layers)
        self._params = params
        self._grads = grads
        self._others = [
            (la.adapter.weight, la.adapter.weight.grad is not None)
            for la in layers
            if la not in taking
        ]
        self.recordings += 1
        return True

    def _on(self, device: torch.device) -> None:
        """The scalars and the tally on ``device`` (made anew if it changed:
        the old tally stays with the steps it counted)."""
        if self._scalars is None or self._device != device:
            self._device = device
            self._scalars = torch.zeros(3, dtype=torch.float64, device=device)
            self._values = [None, None, None]
            self.tally = VerdictTally(device)

    def _fill(
        self, damping: float | Tensor, lr: float | Tensor, kl_clip: float | Tensor | None
    ) -> None:
        """The scalars the graph reads, refilled where their value changed
        (one small launch each; an optimizer's tensor learning rate is
        copied every step: comparing it would read it)."""
        assert self._scalars is not None
        for i, value in enumerate((damping, lr, kl_clip)):
            if isinstance(value, Tensor):
                self._scalars[i].copy_(value.reshape(()))
                self._values[i] = None
            elif value is not None and value != self._values[i]:
                self._scalars[i].fill_(value)
                self._values[i] = value
