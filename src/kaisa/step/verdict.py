"""Whether a step's gradients may be used: the scaler's verdict, the
engine's, else kaisa's own finiteness check — read now, or left on the
device where a read costs a synchronisation (:mod:`kaisa.step.nonfinite`).

The verdict is the same on every rank: where gradients are not averaged by
the engine, one small collective carries each rank's finiteness and its
layers' gradient presence together (the presence the gradient application
would otherwise agree on separately), and over the model-parallel groups,
whose ranks must skip together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from kaisa.distributed.communicator import Communicator
from kaisa.engines.base import Engine
from kaisa.layers.state import KFACLayer
from kaisa.step.loss_scaling import LossScaling
from kaisa.step.nonfinite import NonFiniteSteps, finite_verdict, gradients_finite
from kaisa.step.skip import SkippedUpdates

__all__ = ["StepVerdict", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """One step's verdict.

    Attributes:
        valid: the step may change anything (False: it is skipped).
        presence: each layer's gradient presence, and-ed over the group with
            the finiteness check (None: not agreed on here).
        verdict_of: where the check stays on the device, what forms it from
            the gradients before they change (None: settled, or the scaler's).
        deferred: the check stays on the device (the step is valid for now).
    """

    valid: bool
    presence: Mapping[str, bool] | None = None
    verdict_of: Callable[[], Tensor | None] | None = None
    deferred: bool = False


class StepVerdict:
    """Judges each step; counts and reports the non-finite ones (:attr:`nonfinite`).

    Args:
        layers: the registered layers (their gradients are checked).
        comm: the data-parallel group's communicator.
        engine: where the gradients live (its own verdict, its presence).
        scaling: the ``GradScaler``, where one is given.
        may_defer: what of deferring is fixed at construction: the method
            changes no state while applying, no model parallelism, and the
            engine averages gradients where there are several ranks.
        reads_free: whether a scalar on a device is read as a number.
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        comm: Communicator,
        engine: Engine,
        scaling: LossScaling,
        may_defer: bool,
        reads_free: Callable[[torch.device], bool],
    ) -> None:
        self.layers = layers
        self.adapters = [la.adapter for la in layers]
        self.comm = comm
        self.engine = engine
        self.scaling = scaling
        self._may_defer = may_defer
        self._reads_free = reads_free
        self.nonfinite = NonFiniteSteps()
        #: whether the last judged step was skipped for non-finite gradients
        self.skipped_nonfinite = False
        #: what keeps a skipped step's update still (:meth:`keep_updates`)
        self.updates: SkippedUpdates | None = None

    def keep_updates(self, updates: SkippedUpdates) -> None:
        """Hand each verdict to what keeps a skipped step's update still, and
        let the reports say what it does."""
        self.updates = updates
        self.nonfinite.gradients = updates.report
        self.nonfinite.deferred_update = updates.deferred

    def judge(self, factor_step: bool, call: int) -> Verdict:
        """This step's verdict; ``call``: the ``step()`` call it is (what a
        skip report names).  A non-factor step's check stays on the device
        where a read is not free (:meth:`deferrable`)."""
        self.skipped_nonfinite = False
        if not factor_step and self.deferrable():
            # formed in the application, before the gradients change (inside
            # a replayed step's graph there); a scaler's skips are its own
            owed = self.scaling.found_inf() is None
            return Verdict(True, None, self.on_device if owed else None, deferred=True)
        self.nonfinite.settle()
        if self.updates is not None:
            self.updates.read()
        return self._settled(call)

    def deferrable(self) -> bool:
        """Whether this step's finiteness check may stay on the device: a
        read is not free, the method changes no state while applying, and
        the verdict needs no collective (one process, or gradients the
        engine has already averaged)."""
        return (
            self._may_defer
            and not self._reads_free(self.adapters[0].device)
            and self.engine.step_is_valid() is True
        )

    def on_device(self) -> Tensor | None:
        """The deferred finiteness verdict of this step's gradients (on the
        device), handed to the optimizer where it reads one."""
        finite = finite_verdict(self.engine.local_gradients(self.adapters))
        if finite is not None and self.updates is not None:
            self.updates.on_device(finite)
        return finite

    def _settled(self, call: int) -> Verdict:
        """The grad scaler's verdict and the engine's own (DeepSpeed's fp16
        overflow), the same on every rank: one small collective when either
        has one.  Without either, the gradients are checked here."""
        engine_verdict = self.engine.step_is_valid()
        found = self.scaling.found_inf()
        if found is None and engine_verdict is True:
            return self._finite(call)
        verdicts = [engine_verdict, True if found is None else found == 0]
        local = all(bool(v) for v in verdicts if v is not True)
        return Verdict(self.comm.agree_all([local], self.adapters[0].device)[0])

    def _finite(self, call: int) -> Verdict:
        """Whether every registered layer's gradient is finite on every rank.
        Where DDP has averaged the gradients a NaN on one rank is a NaN on
        all, so each rank's own check is the verdict; elsewhere it travels
        with the layers' gradient presence in the one collective the
        gradient application would run anyway."""
        adapters = self.adapters
        device = adapters[0].device
        finite = gradients_finite(self.engine.local_gradients(adapters))
        presence = None
        if self.comm.distributed and not self.engine.gradients_agree():
            present = [self.engine.present(a) for a in adapters]
            agreed = self.comm.agree_all([finite, *present], device)
            finite = agreed[0]
            presence = {la.name: ok for la, ok in zip(self.layers, agreed[1:])}
        finite = self.comm.agree_model_parallel(finite, device)
        if not finite:
            self.skipped_nonfinite = True
            self.nonfinite.record(call)
        return Verdict(finite, presence)
