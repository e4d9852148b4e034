"""What one run trains: command-line options merged with the task's defaults.

Resolution order for every hyperparameter is: the command line, then the
task's default, then (for K-FAC) the library's default. Resolving here, once,
means the training loop never looks at ``argparse`` and ``results.json``
records the values actually used.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kaisa.config import KFACConfig
from kaisa_lab.cli.options import kfac_overrides
from kaisa_lab.optim import KFAC_BASES
from kaisa_lab.tasks.base import Task

__all__ = ["OptimizerError", "RunSpec", "ScheduleError", "build_specs", "optimizers_of"]

#: Options that set one value for every arm, which cannot fit several optimizers.
_ONE_OPTIMIZER_OPTIONS: tuple[tuple[str, str], ...] = (
    ("lr", "--lr"),
    ("kfac_arm_lr", "--kfac-arm-lr"),
    ("weight_decay", "--weight-decay"),
)


class ScheduleError(ValueError):
    """The learning-rate schedule options do not fit the run (message names the option)."""


class OptimizerError(ValueError):
    """The optimizer options do not fit the command (message names the option)."""


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
    #: Whether ``lr`` was tuned for the task (given on the command line, or
    #: the task names one): False for a baseline at its library's lr.
    lr_tuned: bool = True
    #: ``muon`` only: lr and weight decay of the AdamW that trains the
    #: embeddings, head, norms and biases (the task's AdamW ones).
    adamw_lr: float | None = None
    adamw_weight_decay: float | None = None
    #: heavyball's baselines (soap, shampoo) compiled as their library does by
    #: default (the compilation falls in the untimed warm-up), or eager
    compile_baseline: bool = True
    #: the model compiled with ``torch.compile`` under this backend after
    #: K-FAC is attached, for every arm alike (None: eager;
    #: :mod:`kaisa_lab.cli.compiled`): its statistics formed inside the graphs
    compile_model: str | None = None
    #: ``muon`` only: Newton–Schulz iterations per step (torch's default 5); a
    #: lever to measure: fewer, once K-FAC has whitened the direction
    muon_ns_steps: int = 5
    #: levers under measurement (:mod:`kaisa_lab.levers`): the eigen method's
    #: inverse power (None: the run's method as configured), and the Fisher
    #: whose G a factor step captures
    eigen_power: float | None = None
    fisher: str = "empirical"
    #: the fraction of a sequence layer's positions its factor statistics read
    #: (None: every position)
    position_fraction: float | None = None
    #: which layers K-FAC preconditions: "all" it registers, or under Muon
    #: "adamw-part", the ones Muon hands to AdamW (embeddings, head)
    kfac_layers: str = "all"
    #: a tuning campaign's cost pair this run is one of (the key of the setting
    #: whose step cost the pair times, :mod:`kaisa_lab.bench.protocol`): it
    #: trains as any run does; the field only keeps its record apart from the
    #: tuning's run of the same setting
    cost_pair: str | None = None

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
            "lr_tuned": self.lr_tuned,
            "adamw_lr": self.adamw_lr,
            "adamw_weight_decay": self.adamw_weight_decay,
            "compile_baseline": self.compile_baseline,
            "kfac": kfac,
            # written where it differs from torch's: records written before
            # the option existed still describe the same runs
            **({"muon_ns_steps": self.muon_ns_steps} if self.muon_ns_steps != 5 else {}),
            **({"eigen_power": self.eigen_power} if self.eigen_power is not None else {}),
            **({"fisher": self.fisher} if self.fisher != "empirical" else {}),
            **({"kfac_layers": self.kfac_layers} if self.kfac_layers != "all" else {}),
            **({"cost_pair": self.cost_pair} if self.cost_pair is not None else {}),
            **({"compile_model": self.compile_model} if self.compile_model is not None else {}),
            **(
                {"position_fraction": self.position_fraction}
                if self.position_fraction is not None
                else {}
            ),
        }


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _arm_schedule(
    args: argparse.Namespace, task: Task, use_kfac: bool, optimizer: str
) -> tuple[float, str, float]:
    """``(lr, schedule, warm-up epochs)`` of one arm.

    For the K-FAC arm: ``--kfac-arm-*``, then the option both arms share
    (``--lr``, ``--schedule``, ``--warmup-epochs``), then the task's setting
    for the arm (the benchmark suite's selection, else its prior,
    :meth:`Task.arm`); the first-order arm skips the first."""
    lr, schedule, warmup = task.arm(use_kfac, optimizer)
    lr = float(_pick(args.lr, lr))
    schedule = _pick(args.schedule, schedule)
    warmup = float(_pick(args.warmup_epochs, warmup))
    if use_kfac:
        lr = float(_pick(args.kfac_arm_lr, lr))
        schedule = _pick(args.kfac_arm_schedule, schedule)
        warmup = float(_pick(args.kfac_arm_warmup_epochs, warmup))
    return lr, schedule, warmup


def optimizers_of(args: argparse.Namespace, task: Task) -> list[str]:
    """The optimizers of the command: ``--optimizers``, else ``--optimizer``, else the task's.

    Raises :class:`OptimizerError` when several optimizers meet an option that
    sets one value for every arm (each arm takes its own from the task).
    """
    several = getattr(args, "optimizers", None)
    if several is None:
        return [_pick(args.optimizer, task.defaults.optimizer)]
    if args.optimizer is not None:
        raise OptimizerError("argument --optimizers: not allowed with argument --optimizer")
    if len(several) > 1:
        for dest, flag in _ONE_OPTIMIZER_OPTIONS:
            if getattr(args, dest, None) is not None:
                raise OptimizerError(
                    f"argument {flag}: one value cannot serve several optimizers "
                    f"(--optimizers {','.join(several)}); each arm takes its task's own "
                    "(compare one optimizer to set it)"
                )
    return list(several)


def _arms(optimizers: Sequence[str], kfac_flags: Sequence[bool]) -> list[tuple[str, bool]]:
    """``(optimizer, kfac)`` per arm: each optimizer's runs in ``kfac_flags`` order, its
    K-FAC run left out where K-FAC does not apply on top of it (``compare``) and
    refused where it was asked for alone (``train --kfac``)."""
    arms = []
    for optimizer in optimizers:
        for use_kfac in kfac_flags:
            if use_kfac and optimizer not in KFAC_BASES:
                if len(kfac_flags) == 1:
                    raise OptimizerError(
                        f"argument --optimizer: K-FAC does not run on top of {optimizer} (it "
                        "preconditions with its own Kronecker factors); K-FAC's bases are "
                        f"{', '.join(sorted(KFAC_BASES))}; train {optimizer} with --no-kfac"
                    )
                continue
            arms.append((optimizer, use_kfac))
    return arms


def _spec(
    args: argparse.Namespace, task: Task, optimizer: str, use_kfac: bool, common: dict[str, Any]
) -> RunSpec:
    """The spec of one arm; ``common`` holds what every arm shares."""
    defaults = task.defaults
    lr, schedule, warmup_epochs = _arm_schedule(args, task, use_kfac, optimizer)
    if warmup_epochs > common["epochs"]:
        own = use_kfac and args.kfac_arm_warmup_epochs is not None
        option = "--kfac-arm-warmup-epochs" if own else "--warmup-epochs"
        raise ScheduleError(
            f"argument {option}: {warmup_epochs:g} warm-up epochs is more than the "
            f"{common['epochs']} epochs of training"
        )
    given = args.lr is not None or (use_kfac and args.kfac_arm_lr is not None)
    muon = optimizer == "muon"
    return RunSpec(
        name=f"{optimizer}+kfac" if use_kfac else optimizer,
        task=task.name,
        optimizer=optimizer,
        kfac=use_kfac,
        lr=lr,
        weight_decay=_pick(args.weight_decay, defaults.decay(optimizer)),
        schedule=schedule,
        warmup_epochs=warmup_epochs,
        kfac_kwargs=_kfac_kwargs(args, task, optimizer) if use_kfac else {},
        lr_tuned=given or task.lr_tuned(optimizer, use_kfac),
        adamw_lr=defaults.base_lr("adamw") if muon else None,
        adamw_weight_decay=defaults.decay("adamw") if muon else None,
        **common,
    )


def _kfac_kwargs(args: argparse.Namespace, task: Task, optimizer: str) -> dict[str, Any]:
    """The K-FAC keywords of the K-FAC arm on ``optimizer``: the loss's averaging,
    the knobs the suite selected for the arm (:meth:`Task.kfac_for`; none at the
    library's defaults), then what the command line set."""
    return {
        "loss_average": task.loss_average,
        **task.kfac_for(optimizer),
        **kfac_overrides(args),
    }


def build_specs(
    args: argparse.Namespace,
    task: Task,
    kfac_flags: list[bool],
    optimizers: Sequence[str] | None = None,
) -> list[RunSpec]:
    """One :class:`RunSpec` per optimizer (default: :func:`optimizers_of`) and entry of
    ``kfac_flags``, identical except for the optimizer (and its lr, weight decay and
    schedule, the task's for that arm), K-FAC, and what ``--kfac-arm-*`` sets.
    An optimizer K-FAC does not apply to
    (:data:`kaisa_lab.optim.KFAC_BASES`) gets no K-FAC run.

    Raises ``ValueError``/``TypeError`` (from :class:`KFACConfig`) when the
    merged K-FAC options are inconsistent, :class:`ScheduleError` when the
    warm-up is longer than training and :class:`OptimizerError` when the
    optimizer options do not fit.
    """
    defaults = task.defaults
    optimizers = optimizers_of(args, task) if optimizers is None else list(optimizers)
    for optimizer in optimizers:  # validate every arm's options before any training
        lr = _pick(args.lr, defaults.base_lr(optimizer))
        KFACConfig.from_options(**{"lr": lr, **_kfac_kwargs(args, task, optimizer)})
    steps = defaults.steps_per_epoch
    if args.max_steps_per_epoch is not None:
        steps = args.max_steps_per_epoch if steps is None else min(steps, args.max_steps_per_epoch)
    common: dict[str, Any] = {
        "epochs": _pick(args.epochs, defaults.epochs),
        "batch_size": _pick(args.batch_size, defaults.batch_size),
        "momentum": _pick(args.momentum, defaults.momentum),
        "seed": args.seed,
        "target": _pick(args.target, task.target),
        "steps_per_epoch": steps,
        "eval_batch_size": defaults.eval_batch_size,
        "stop_at_target": args.stop_at_target,
        "evals_per_epoch": _pick(args.evals_per_epoch, defaults.evals_per_epoch),
        "compile_baseline": getattr(args, "compile_baselines", True),
        "compile_model": getattr(args, "compile_model", None),
    }
    return [
        _spec(args, task, optimizer, use_kfac, common)
        for optimizer, use_kfac in _arms(optimizers, kfac_flags)
    ]
