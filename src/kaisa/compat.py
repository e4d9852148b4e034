"""What a kfac-pytorch script reads from and writes to its preconditioner.

kaisa promises that a kfac-pytorch user switches by changing one import.
Beyond the constructor's keywords that means the attributes kfac-pytorch's
``KFACPreconditioner`` exposes: its configuration (``compute_method``,
``grad_worker_fraction``, ``distributed_strategy``, …), its hyperparameters
as readable and settable values, and the private names its
``kfac.scheduler.LambdaParamScheduler`` multiplies (``_damping``,
``_factor_update_steps``, …, ``_steps``).  They live here, as a mixin of
the facade, so that :mod:`kaisa.preconditioner` stays the orchestration
and this module is the one place the compatibility surface is kept.

kfac-pytorch is never imported: its enum members are recognised by name
(:func:`kaisa.config.as_enum`) and kaisa's members compare equal to them
(:class:`kaisa.core.options.SameNameEquality`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import torch

from kaisa.config import (
    AllreduceMethod,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    check_number,
    plain_number,
)
from kaisa.view import PreconditionerView
from kaisa.warn import warn_user

if TYPE_CHECKING:
    from kaisa.step.schedule import Schedule

__all__ = ["KfacPytorchAttributes", "is_kfac_pytorch_state", "refuse_kfac_pytorch_state"]


class _ScheduleOption:
    """A schedule option as an attribute of the preconditioner.

    ``precond.damping`` reads the value at the current step (a callable is
    evaluated) and ``precond.damping = 0.01`` sets it, validated at once.
    The underscored twin ``precond._damping`` is kfac-pytorch's: it reads the
    option as held (number or callable) and sets it unvalidated, as
    kfac-pytorch's ``LambdaParamScheduler`` does; an out-of-range value is
    refused by the next ``step()`` that uses it, naming the option.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.option = name.lstrip("_")
        self.raw = name.startswith("_")

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        schedule: Schedule = obj._schedule
        if self.raw:
            return schedule.stored(self.option)
        return schedule.current(self.option, obj.steps)

    def __set__(self, obj: Any, value: Any) -> None:
        obj._schedule.set(self.option, value, check=not self.raw)
        if self.option == "factor_update_steps":
            obj._refresh_capture()  # whether the next step captures may change


class KfacPytorchAttributes(PreconditionerView):
    """kfac-pytorch's attributes, mixed into :class:`kaisa.KFACPreconditioner`."""

    # hyperparameters: the value now (read), validated (write)
    factor_update_steps = _ScheduleOption()
    inv_update_steps = _ScheduleOption()
    damping = _ScheduleOption()
    factor_decay = _ScheduleOption()
    kl_clip = _ScheduleOption()
    lr = _ScheduleOption()
    # kfac-pytorch's private names, written by its LambdaParamScheduler
    _factor_update_steps = _ScheduleOption()
    _inv_update_steps = _ScheduleOption()
    _damping = _ScheduleOption()
    _factor_decay = _ScheduleOption()
    _kl_clip = _ScheduleOption()
    _lr = _ScheduleOption()

    @property
    def _steps(self) -> int:
        """kfac-pytorch's step counter (its tests and schedulers set it)."""
        return self.steps

    @_steps.setter
    def _steps(self, value: int) -> None:
        value = plain_number("_steps", value)  # np.int64 from a scheduler's arithmetic
        check_number("_steps", value, low=0, integer=True)
        self._parts.pipeline.steps = value
        self._refresh_capture()

    def _refresh_capture(self) -> None:
        """Capture in the coming passes iff the next step is a factor step."""
        # an interval out of range is refused by the next step() that uses it
        with suppress(TypeError, ValueError, ZeroDivisionError):
            self._parts.capture.begin_step(self.steps, self._schedule.is_factor_step(self.steps))

    def _warn_memory_opt_without_colocation(self) -> None:
        """kfac-pytorch forces ``colocate_factors=True`` under MEM-OPT and warns;
        kaisa honours the choice (exactly), and says so, so that a migrating
        user is not surprised by where the factors live."""
        if self.colocate_factors or self.distributed_strategy is not DistributedStrategy.MEM_OPT:
            return
        warn_user(
            "colocate_factors=False under MEM-OPT (one gradient worker per layer): kaisa keeps "
            "it, so a layer's factors may be decomposed on different ranks and both sent to the "
            "layer's worker (kfac-pytorch would force colocate_factors=True). The result is "
            "the same either way; colocation saves the second transfer",
        )

    def reset_batch(self) -> None:
        """kfac-pytorch's: forget the statistics captured since the last
        ``step()``.  The next step folds none into the factors (it still
        preconditions with the factors it has).  Statistics already sent
        during backward are dropped on arrival, so call it on every rank,
        as ``step()`` is."""
        self._parts.pipeline.reduction.forget_batch()

    # -- configuration, as kfac-pytorch exposes it --------------------------------------
    @property
    def compute_method(self) -> ComputeMethod | str:
        """The method that runs: a :class:`ComputeMethod` for the library's
        (given by name or as an object), the ``name`` of a method of one's own."""
        name = self._parts.method.name
        known = {m.value for m in ComputeMethod}
        return ComputeMethod(name) if name in known else name

    @property
    def assignment_strategy(self) -> AssignmentStrategy:
        return self.config.assignment_strategy

    @property
    def grad_worker_fraction(self) -> float:
        """The fraction in force: ``DistributedStrategy`` members, 0 and
        ``'auto'`` resolved (1, 0.5, 1/world size, …), as kfac-pytorch reports it."""
        return float(self.plan.grad_worker_fraction)

    @property
    def distributed_strategy(self) -> DistributedStrategy:
        """COMM_OPT (f = 1), MEM_OPT (one worker per layer) or HYBRID_OPT."""
        given = self.config.grad_worker_fraction
        if isinstance(given, DistributedStrategy) and given is not DistributedStrategy.AUTO:
            return given
        if self.plan.grad_workers == self.plan.world_size:
            return DistributedStrategy.COMM_OPT
        if self.plan.grad_workers == 1:
            return DistributedStrategy.MEM_OPT
        return DistributedStrategy.HYBRID_OPT

    @property
    def colocate_factors(self) -> bool:
        return self.config.colocate_factors

    @property
    def compute_eigenvalue_outer_product(self) -> bool:
        return self.config.compute_eigenvalue_outer_product

    @property
    def symmetry_aware(self) -> bool:
        return self.config.symmetry_aware

    @property
    def allreduce_bucket_cap_mb(self) -> float:
        return self.config.allreduce_bucket_cap_mb

    @property
    def allreduce_method(self) -> AllreduceMethod:
        if self.config.allreduce_bucket_cap_mb > 0:
            return AllreduceMethod.ALLREDUCE_BUCKETED
        return AllreduceMethod.ALLREDUCE

    @property
    def accumulation_steps(self) -> int:
        return self.config.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        """Set between steps, for the coming ones (kfac-pytorch's attribute is
        settable): a loop whose last step of an epoch has fewer micro-batches,
        and divides its loss by that count, says so here."""
        value = plain_number("accumulation_steps", value)
        check_number("accumulation_steps", value, low=1, integer=True)
        engine = self._parts.engine
        if engine.defaults().accumulation_steps is not None:
            raise ValueError(
                f"accumulation_steps is the {engine.name} engine's (it accumulates the "
                "micro-batches of each step); it cannot be set"
            )
        self._parts.capture.set_accumulation_steps(value)
        self._schedule.fix(accumulation_steps=value)

    @property
    def update_factors_in_hook(self) -> bool:
        return self.config.update_factors_in_hook

    @property
    def factor_dtype(self) -> torch.dtype | None:
        return self.config.factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype | None:
        return self.config.inv_dtype

    @property
    def skip_layers(self) -> list[str]:
        return list(self.config.skip_layers)


# -- kfac-pytorch's checkpoints -------------------------------------------------------------


def is_kfac_pytorch_state(state: Any) -> bool:
    """A ``kfac.preconditioner.KFACPreconditioner.state_dict()``: the steps and
    its non-callable schedule values at the top level, no kaisa version or
    ``hyperparameters``, layers (if any) as ``{'A', 'G'}``.

    One whose schedule values were all callables holds only ``steps`` and
    ``layers``, like a hand-made kaisa state, and is not told apart."""
    if not isinstance(state, Mapping) or "steps" not in state:
        return False
    if "version" in state or "hyperparameters" in state:
        return False
    if not any(
        k in state
        for k in (
            "factor_update_steps",
            "inv_update_steps",
            "damping",
            "factor_decay",
            "kl_clip",
            "lr",
        )
    ):
        return False
    layers = state.get("layers")
    return layers is None or (
        isinstance(layers, Mapping)
        and all(isinstance(e, Mapping) and set(e) == {"A", "G"} for e in layers.values())
    )


def refuse_kfac_pytorch_state() -> ValueError:
    """Why a kfac-pytorch checkpoint is not loaded, and what to do instead."""
    return ValueError(
        "this state_dict was written by kfac-pytorch, whose factors are on another "
        "scale: its G is the covariance of the output gradients of the *mean* loss "
        "(1/N² of kaisa's for a batch of N, so it depends on the batch size, which the "
        "checkpoint does not record), its Conv2d factors are further divided by the output's "
        "spatial size, and its running averages start from the identity. Loading it would "
        "precondition with a curvature off by orders of magnitude, so kaisa refuses it. "
        "Start kaisa's factors afresh (they are re-estimated from the next factor step: "
        "load the model and optimizer only), or pass "
        "kaisa.compat.kfac_pytorch_schedule(state) to load_state_dict to keep kfac-pytorch's "
        "step count and schedule values without its factors"
    )


def kfac_pytorch_schedule(state: Mapping[str, Any]) -> dict[str, Any]:
    """A kaisa state holding a kfac-pytorch checkpoint's step count and its
    non-callable schedule values, without its factors (see
    :func:`refuse_kfac_pytorch_state` for why they are not converted)."""
    if not is_kfac_pytorch_state(state):
        raise ValueError("kfac_pytorch_schedule takes a kfac-pytorch state_dict")
    from kaisa.checkpoint.state import STATE_VERSION
    from kaisa.step.schedule import RESTORED

    return {
        "version": STATE_VERSION,
        "steps": state["steps"],
        "hyperparameters": {k: state[k] for k in RESTORED if k in state},
    }
