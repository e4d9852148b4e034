"""What one run trains: command-line options merged with the task's defaults.

Resolution order for every hyperparameter is: the command line, then the
task's default, then (for K-FAC) the library's default. Resolving here, once,
means the training loop never looks at ``argparse`` and ``results.json``
records the values actually used.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kaisa.config import KFACConfig
from kaisa_lab.cli.options import kfac_overrides
from kaisa_lab.tasks.base import Task

__all__ = ["RunSpec", "ScheduleError", "build_specs"]


class ScheduleError(ValueError):
    """The learning-rate schedule options do not fit the run (message names the option)."""


@dataclass(frozen=True)
class RunSpec:
    """One fully-resolved training configuration."""

    name: str
    task: str
    optimizer: str
    kfac: bool
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    target: float
    steps_per_epoch: int | None
    eval_batch_size: int
    stop_at_target: bool = False
    #: Evaluations per epoch, at evenly spaced steps (the last at the epoch's end).
    evals_per_epoch: int = 1
    #: Learning-rate schedule (:mod:`kaisa_lab.cli.schedule`) and its warm-up length.
    schedule: str = "constant"
    warmup_epochs: float = 0.0
    #: Keywords for ``KFACPreconditioner`` besides ``optimizer``; contains
    #: ``lr`` only when the user gave ``--kfac-lr``.
    kfac_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def kfac_config(self) -> KFACConfig:
        """The K-FAC configuration in effect, with the optimizer's lr unless overridden."""
        return KFACConfig.from_options(**{"lr": self.lr, **self.kfac_kwargs})

    def to_dict(self) -> dict[str, Any]:
        """Every hyperparameter, JSON-ready; ``kfac`` is null for first-order runs."""
        kfac: dict[str, Any] | None = None
        if self.kfac:
            kfac = self.kfac_config().hyperparameters()
            kfac["lr_from_optimizer"] = "lr" not in self.kfac_kwargs
        return {
            "task": self.task,
            "optimizer": self.optimizer,
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "seed": self.seed,
            "target": self.target,
            "steps_per_epoch": self.steps_per_epoch,
            "eval_batch_size": self.eval_batch_size,
            "stop_at_target": self.stop_at_target,
            "evals_per_epoch": self.evals_per_epoch,
            "schedule": self.schedule,
            "warmup_epochs": self.warmup_epochs,
            "kfac": kfac,
        }


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _arm_schedule(
    args: argparse.Namespace, task: Task, use_kfac: bool, optimizer: str
) -> tuple[float, str, float]:
    """``(lr, schedule, warm-up epochs)`` of one arm.

    For the K-FAC arm: ``--kfac-arm-*``, then the option both arms share
    (``--lr``, ``--schedule``, ``--warmup-epochs``), then the task's
    ``kfac_arm`` default, then the task's default; the first-order arm skips
    the first and third."""
    defaults = task.defaults
    lr, schedule, warmup = defaults.arm(use_kfac, optimizer)
    lr = float(_pick(args.lr, lr))
    schedule = _pick(args.schedule, schedule)
    warmup = float(_pick(args.warmup_epochs, warmup))
    if use_kfac:
        lr = float(_pick(args.kfac_arm_lr, lr))
        schedule = _pick(args.kfac_arm_schedule, schedule)
        warmup = float(_pick(args.kfac_arm_warmup_epochs, warmup))
    return lr, schedule, warmup


def build_specs(args: argparse.Namespace, task: Task, kfac_flags: list[bool]) -> list[RunSpec]:
    """One :class:`RunSpec` per entry of ``kfac_flags``, identical except for
    K-FAC and for what ``--kfac-arm-*`` (or the task's ``kfac_arm``) sets.

    Raises ``ValueError``/``TypeError`` (from :class:`KFACConfig`) when the
    merged K-FAC options are inconsistent, and :class:`ScheduleError` when the
    warm-up is longer than training.
    """
    defaults = task.defaults
    optimizer = _pick(args.optimizer, defaults.optimizer)
    kfac_kwargs: dict[str, Any] = {
        "loss_average": task.loss_average,
        **defaults.kfac,
        **kfac_overrides(args),
    }
    shared_lr = _pick(args.lr, defaults.lr[optimizer])
    KFACConfig.from_options(**{"lr": shared_lr, **kfac_kwargs})  # validate before any training
    epochs = _pick(args.epochs, defaults.epochs)
    steps = defaults.steps_per_epoch
    if args.max_steps_per_epoch is not None:
        steps = args.max_steps_per_epoch if steps is None else min(steps, args.max_steps_per_epoch)
    specs = []
    for use_kfac in kfac_flags:
        lr, schedule, warmup_epochs = _arm_schedule(args, task, use_kfac, optimizer)
        if warmup_epochs > epochs:
            own = use_kfac and args.kfac_arm_warmup_epochs is not None
            option = "--kfac-arm-warmup-epochs" if own else "--warmup-epochs"
            raise ScheduleError(
                f"argument {option}: {warmup_epochs:g} warm-up epochs is more than the "
                f"{epochs} epochs of training"
            )
        specs.append(
            RunSpec(
                name=f"{optimizer}+kfac" if use_kfac else optimizer,
                task=task.name,
                optimizer=optimizer,
                kfac=use_kfac,
                epochs=epochs,
                batch_size=_pick(args.batch_size, defaults.batch_size),
                lr=lr,
                momentum=_pick(args.momentum, defaults.momentum),
                weight_decay=_pick(args.weight_decay, defaults.weight_decay[optimizer]),
                seed=args.seed,
                target=_pick(args.target, task.target),
                steps_per_epoch=steps,
                eval_batch_size=defaults.eval_batch_size,
                stop_at_target=args.stop_at_target,
                evals_per_epoch=_pick(args.evals_per_epoch, defaults.evals_per_epoch),
                schedule=schedule,
                warmup_epochs=warmup_epochs,
                kfac_kwargs=dict(kfac_kwargs) if use_kfac else {},
            )
        )
    return specs
