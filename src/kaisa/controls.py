"""How the step runs, set from outside the training loop: compiled or
replayed, timed, its scalars read or kept on the device, its layers
stacked, its KL clip recorded.

None of these changes what a step computes (to rounding); each either makes
it cheaper or lets it be measured.  The facade
(:class:`kaisa.KFACPreconditioner`) takes them from this mixin, as it takes
its checkpoints from :mod:`kaisa.checkpoint.facade`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kaisa import torch_support
from kaisa.step.diagnostics import StepDiagnostics
from kaisa.step.graphed import CUDA_GRAPH_MODES, GraphedApplication, Recorder
from kaisa.step.profile import StepProfile
from kaisa.view import PreconditionerView

__all__ = ["StepControls"]


class StepControls(PreconditionerView):
    """``compile()``, ``diagnostics``, ``profile``, ``read_scalars``, ``stacking``."""

    def compile(self, *, recorder: Callable[[], Recorder] | None = None, **options: Any) -> None:
        """Compile the preconditioning of the stacked layers
        (``torch.compile(**options)``, whole graph; like ``nn.Module.compile``).

        Layers of one shape (a Transformer's blocks, on their workers, the eigen and
        inverse methods: :mod:`kaisa.step.batched`) are preconditioned by one
        kernel per group; compiled, its products, division and KL terms are
        one graph (two compilations in all: the first shape, then one with
        dynamic shapes for every other; a damping schedule recompiles nothing).

        On CUDA, ``mode='reduce-overhead'`` (or ``'max-autotune'``) records a
        non-factor step's whole application — reads, products, KL clip,
        writes — as one CUDA graph, replayed each non-factor step and recorded
        again after each inverse update (:mod:`kaisa.step.graphed`); the
        groups' kernel inside it is compiled without graphs of its own.  The
        rest of ``step()`` runs as before: ``torch.compile(precond.step)``
        also works, with graph breaks at every collective and decision.

        ``recorder`` makes the object that records and replays a non-factor
        step's application in place of a CUDA graph, on any device (a
        :class:`kaisa.step.graphed.Recorder`): one whose replay does nothing
        leaves the host's own part of a replayed step, which can then be
        timed on a CPU.  Given alone (no ``options``), it leaves the groups'
        kernel as it is.

        Compiling needs torch at or past :data:`kaisa.torch_support.COMPILE_FLOOR`;
        on an older release this raises a ``RuntimeError`` that names it."""
        if (recorder is None or options) and not torch_support.COMPILE_SUPPORTED:
            raise RuntimeError(torch_support.compile_refusal("precond.compile()"))
        pipeline = self._parts.pipeline
        graphs = options.get("mode") in CUDA_GRAPH_MODES
        on_cuda = any(la.adapter.device.type == "cuda" for la in self._parts.layers.values())
        if recorder is not None or (graphs and on_cuda):
            if graphs:
                options["mode"] = CUDA_GRAPH_MODES[options["mode"]]
            application = pipeline.application
            pipeline.graphed = (
                GraphedApplication(application)
                if recorder is None
                else GraphedApplication(application, recorder)
            )
        else:  # compiled again without graphs: no replay from now on
            pipeline.graphed = None
        if recorder is None or options:
            pipeline.application.groups.compile(**options)

    @property
    def diagnostics(self) -> StepDiagnostics | None:
        """A :class:`kaisa.step.diagnostics.StepDiagnostics` the step fills
        (the KL clip's ``ν`` per step) while set; None (default): nothing recorded."""
        return self._parts.pipeline.application.diagnostics

    @diagnostics.setter
    def diagnostics(self, value: StepDiagnostics | None) -> None:
        if value is not None and not isinstance(value, StepDiagnostics):
            raise TypeError(
                "diagnostics must be a kaisa.step.diagnostics.StepDiagnostics or None; "
                f"got {value!r}"
            )
        self._parts.pipeline.application.diagnostics = value

    @property
    def profile(self) -> StepProfile | None:
        """A :class:`kaisa.step.profile.StepProfile` the step fills with the
        wall time of each of its phases (and the capture hooks') while set;
        None (default): nothing timed, and no clock read."""
        return self._parts.pipeline.profile

    @profile.setter
    def profile(self, value: StepProfile | None) -> None:
        if value is not None and not isinstance(value, StepProfile):
            raise TypeError(
                f"profile must be a kaisa.step.profile.StepProfile or None; got {value!r}"
            )
        self._parts.pipeline.profile = value

    @property
    def read_scalars(self) -> bool | None:
        """Whether the step reads its scalars (the KL clip's terms, the
        gradients' finiteness verdict) back to the host as numbers.  None
        (default): where that is free, on a CPU; False keeps them on the
        device, as on an accelerator, so what an accelerator's step launches
        and reads can be counted on a CPU; True reads them everywhere."""
        return self._parts.pipeline.application.read_scalars

    @read_scalars.setter
    def read_scalars(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"read_scalars must be a bool or None; got {value!r}")
        self._parts.pipeline.application.read_scalars = value

    @property
    def stacking(self) -> bool:
        """Whether layers of one shape are preconditioned stacked, one
        product per group (:mod:`kaisa.step.batched`; True by default, for the
        methods that can).  False preconditions every layer on its own (the
        result equal to rounding), to measure what stacking saves."""
        return self._parts.pipeline.application.groups.enabled

    @stacking.setter
    def stacking(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"stacking must be True or False; got {value!r}")
        self._parts.pipeline.application.groups.allowed = value

    @property
    def factor_step(self) -> bool:
        """Whether the next :meth:`step` is a factor step: the forward and
        backward before it are the ones captured.  A loop that runs an extra
        pass for the statistics alone (a backward against labels sampled from
        the model, say) runs it then, and its other passes inside
        :meth:`paused`."""
        pipeline = self._parts.pipeline
        return pipeline.schedule.is_factor_step(pipeline.steps)
