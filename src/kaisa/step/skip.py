"""A step skipped for non-finite gradients changes nothing after it either.

kaisa skips such a step (:mod:`kaisa.step.nonfinite`): no fold, no
decomposition, the step count as it was.  What runs next is the user's
update, and it must change nothing too, or the ``NaN`` reaches every weight.
Who steps the optimizer decides how:

- the user, with ``optimizer=`` given (one optimizer, or every one that
  steps the model: :mod:`kaisa.optimizers`): kaisa takes every gradient of
  their parameters away (sets them to None), which torch's optimizers skip —
  no weight, no momentum, no step count moves;
- an engine that steps its own optimizer (DeepSpeed): the engine's rule
  (:meth:`kaisa.engines.base.OwnsTheLoop.skips_update`), told after every
  step whether it was skipped;
- the user, without ``optimizer=``: ``step()`` returns False and the report
  says to skip ``optimizer.step()``.

On an accelerator a non-factor step's verdict stays on the device
(:mod:`kaisa.step.nonfinite`): the host does not know of the skip in time to
take anything away.  An optimizer that reads a ``found_inf`` tensor (torch's
fused optimizers, the contract ``GradScaler`` uses) is handed kaisa's
verdict in one, written on the device, so its update skips such a step with
no host read; another optimizer's update goes through, as the report says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kaisa.engines.base import Engine, OwnsTheLoop

__all__ = [
    "LEFT",
    "TAKEN",
    "TAKEN_SEVERAL",
    "SkippedUpdates",
    "reads_found_inf",
    "take_gradients",
]

TAKEN = (
    "every gradient of the optimizer's parameters was taken away (set to None), so "
    "its next step changes no weight and no state"
)
TAKEN_SEVERAL = (
    "every gradient of the optimizers' parameters was taken away (set to None), so "
    "their next steps change no weight and no state"
)
LEFT = (
    "the gradients were left as they are: step() returned False, so skip "
    "optimizer.step() for this batch (or pass optimizer= and kaisa takes them away)"
)


def reads_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step reads a ``found_inf`` tensor and skips
    its update where it is nonzero: the contract ``GradScaler`` uses with
    optimizers that declare ``_step_supports_amp_scaling`` (torch's fused
    Adam, AdamW, SGD, Adagrad)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def take_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Every gradient of ``optimizer``'s parameters set to None: its next step
    skips them all."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


class SkippedUpdates:
    """Keeps the update after a skipped step from changing anything.

    Args:
        optimizers: the user's ``optimizer=`` (empty: not given).
        engine: where the gradients live; one that owns the loop may step its
            own optimizer and skip by its own rule.
    """

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], engine: Engine, scaled: bool
    ) -> None:
        owner = engine if isinstance(engine, OwnsTheLoop) else None
        rule = owner.skips_update() if owner is not None else None
        #: the engine told after every step (its rule keeps its own update still)
        self.engine = owner if rule is not None else None
        #: the optimizers whose gradients kaisa takes away (the user steps them)
        self.optimizers = tuple(optimizers) if rule is None else ()
        #: what happens to a skipped step's update, as the skip report says it
        taken = TAKEN if len(self.optimizers) == 1 else TAKEN_SEVERAL
        self.report = rule if rule is not None else taken if self.optimizers else LEFT
        #: per optimizer that reads a ``found_inf`` (and no ``GradScaler``
        #: hands it its own): 1.0 where the step's gradients are not finite
        self.flags: dict[int, torch.Tensor] = {}
        #: a verdict has been written into :attr:`flags` on the device (from then
        #: on a step whose verdict is read clears them: a replayed step writes
        #: them with no Python run, so once is for good)
        self._written = False
        for optimizer in self.optimizers if not scaled else ():
            if reads_found_inf(optimizer):
                device = optimizer.param_groups[0]["params"][0].device
                flag = torch.zeros((), dtype=torch.float32, device=device)
                optimizer.found_inf = flag  # type: ignore[attr-defined]
                self.flags[id(optimizer)] = flag

    @property
    def deferred(self) -> str:
        """What happened to the update of a step whose verdict stayed on the
        device, as the report says it."""
        if self.flags and len(self.flags) == len(self.optimizers):
            return (
                "the optimizer skipped its update on the device (kaisa hands its verdict to "
                "optimizers that read found_inf, as torch's fused ones do)"
            )
        return (
            "its gradients went through (an optimizer that reads found_inf, e.g. fused=True, "
            "skips such an update on the device; precond.read_scalars = True reads every "
            "step's verdict, so such steps are skipped)"
        )

    def on_device(self, finite: torch.Tensor) -> None:
        """A verdict that stays on the device (device work only: it may be
        recorded in a graph): the update reads it."""
        for flag in self.flags.values():
            flag.copy_(finite.logical_not())
        self._written = bool(self.flags)

    def read(self) -> None:
        """A verdict read on the host: the flag is clear (a skip takes the
        gradients away instead, :meth:`after`).  Nothing to do where no
        verdict was ever left on the device (every step on CPU)."""
        if self._written:
            for flag in self.flags.values():
                flag.zero_()

    def detach(self) -> None:
        """Hand the optimizer no verdict any more (its ``found_inf`` is kaisa's
        only while kaisa is attached)."""
        for optimizer in self.optimizers:
            flag = self.flags.get(id(optimizer))
            if flag is not None and getattr(optimizer, "found_inf", None) is flag:
                del optimizer.found_inf  # type: ignore[attr-defined]
        self.flags = {}

    def after(self, skipped: bool) -> None:
        """Called after every ``step()``: ``skipped`` for non-finite gradients."""
        if self.engine is not None:
            self.engine.mark_update(skipped)
        elif skipped:
            for optimizer in self.optimizers:
                take_gradients(optimizer)
