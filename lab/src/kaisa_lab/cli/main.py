"""``kaisa``: train a built-in task with or without K-FAC, or compare both.

``kaisa train`` trains one configuration; ``kaisa compare`` trains the
first-order optimizer and the same optimizer preconditioned by K-FAC, from the
same initial weights and batches, and reports time and steps to a target
metric; ``--optimizers adamw,muon,soap`` compares several optimizers (each with
its K-FAC run where K-FAC applies on top of it, :data:`kaisa_lab.optim.KFAC_BASES`),
each at the task's own lr and schedule for it; ``--seeds N`` repeats that on N
seeds and reports medians and spreads.
Both write ``results.json`` and ``results.png`` into ``--out``.

This module only parses arguments and dispatches; see :mod:`kaisa_lab.cli.spec`
(defaults), :mod:`kaisa_lab.cli.train` (the loop), :mod:`kaisa_lab.cli.sweep` (seeds),
:mod:`kaisa_lab.cli.results`, :mod:`kaisa_lab.cli.summary` and :mod:`kaisa_lab.cli.plot`
(outputs), :mod:`kaisa_lab.cli.distributed` (torchrun).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kaisa import __version__
from kaisa.allocator import tune_cpu_allocator
from kaisa.config import DistributedStrategy
from kaisa.distributed.plan import grad_workers_for
from kaisa_lab.bench.cli import add_bench_parser, run_bench
from kaisa_lab.cli import distributed
from kaisa_lab.cli.compiled import BACKENDS
from kaisa_lab.cli.options import (
    add_kfac_arguments,
    finite_number,
    float_at_least,
    output_folder,
    positive_int,
)
from kaisa_lab.cli.plan import add_plan_parser, run_plan
from kaisa_lab.cli.plot import plot_runs
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.results import (
    arms_to_dicts,
    format_environment,
    format_seed_table,
    format_table,
    load_average,
    write_results,
)
from kaisa_lab.cli.schedule import SCHEDULES
from kaisa_lab.cli.spec import OptimizerError, RunSpec, ScheduleError, build_specs
from kaisa_lab.cli.sweep import run_seeds
from kaisa_lab.cli.train import RunResult, warm_up
from kaisa_lab.optim import OPTIMIZERS, OptionalDependencyError, check_available
from kaisa_lab.tasks.registry import TASKS, get_task

__all__ = ["build_parser", "main"]

RESULTS_JSON = "results.json"
RESULTS_PNG = "results.png"


def _optimizer_list(text: str) -> list[str]:
    """``--optimizers``: comma-separated names from :data:`OPTIMIZERS`, each once."""
    names = [name.strip().lower() for name in text.split(",")]
    unknown = [name for name in names if name not in OPTIMIZERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated optimizers from {', '.join(OPTIMIZERS)}; got {text!r}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"an optimizer is named twice in {text!r}")
    return names


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``train`` and ``compare``; None means "the task's default"."""
    task_help = "; ".join(f"{name}: {cls.description}" for name, cls in TASKS.items()) + "."
    parser.add_argument(
        "--task",
        choices=list(TASKS),
        default="digits-mlp",
        help=f"task to train (default: digits-mlp). {task_help}",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="first-order optimizer (default: the task's: sgd, or adamw on text-lm and "
        "text-cnn). muon: torch.optim.Muon on the hidden weight matrices and AdamW on "
        "embeddings, head, norms and biases; soap, shampoo (heavyball) and lamb "
        "(pytorch-optimizer) need the extra kaisa-lab[baselines]",
    )
    training = parser.add_argument_group("training (unset: the task's default)")
    training.add_argument("--epochs", type=positive_int, help="number of epochs")
    training.add_argument("--batch-size", type=positive_int, help="batch size per rank")
    training.add_argument("--lr", type=float_at_least(0.0, strict=True), help="learning rate")
    training.add_argument("--momentum", type=float_at_least(0.0, strict=False), help="SGD momentum")
    training.add_argument(
        "--weight-decay", type=float_at_least(0.0, strict=False), help="weight decay"
    )
    training.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="learning-rate schedule of both runs (unless --kfac-arm-schedule), applied per "
        "step: constant, or cosine decay to 0 at the last step (after the warm-up)",
    )
    training.add_argument(
        "--warmup-epochs",
        type=float_at_least(0.0, strict=False),
        metavar="EPOCHS",
        help="linear warm-up of the learning rate over this many epochs, both runs unless "
        "--kfac-arm-warmup-epochs (may be fractional; 0: none)",
    )
    _add_kfac_arm_arguments(parser)
    training.add_argument(
        "--max-steps-per-epoch",
        type=positive_int,
        help="cap on optimizer steps per epoch (for quick runs)",
    )
    training.add_argument(
        "--evals-per-epoch",
        type=positive_int,
        metavar="K",
        help="evaluate K times per epoch, at evenly spaced steps, so time and steps to "
        "target are read K times more finely (evaluation is off the clock; default: "
        "the task's, usually 1)",
    )
    training.add_argument("--target", type=finite_number, help="target value of the task's metric")
    training.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end a run at the first evaluation that reaches the target",
    )
    training.add_argument(
        "--seed", type=int, default=0, help="seed of init and data order (default 0)"
    )
    training.add_argument(
        "--seeds",
        type=positive_int,
        default=1,
        metavar="N",
        help="train each configuration on N seeds (--seed, --seed+1, ...) and report the "
        "median and spread of time, steps and epochs to target and of the final metric; "
        "a run that misses the target counts as infinitely slow (default 1)",
    )
    _add_environment_arguments(parser)


def _add_kfac_arm_arguments(parser: argparse.ArgumentParser) -> None:
    """The K-FAC run's own lr, schedule and warm-up (``compare``'s second arm)."""
    arm = parser.add_argument_group(
        "the K-FAC run's own schedule (unset: --lr, --schedule, --warmup-epochs if given, "
        "else the task's setting for the K-FAC arm)",
        "Each arm of a comparison is tuned on its own by the benchmark suite "
        "(docs/benchmarks.md): a preconditioned optimizer may want another learning rate or "
        "no warm-up. Each run's header line and results.json record what it used.",
    )
    arm.add_argument(
        "--kfac-arm-lr",
        type=float_at_least(0.0, strict=True),
        metavar="LR",
        help="learning rate of the K-FAC run (unset: --lr if given, else the lr the suite "
        "selected for the task's K-FAC arm, else the task's prior); its KL clip follows it "
        "unless --kfac-lr is set",
    )
    arm.add_argument(
        "--kfac-arm-schedule", choices=SCHEDULES, help="learning-rate schedule of the K-FAC run"
    )
    arm.add_argument(
        "--kfac-arm-warmup-epochs",
        type=float_at_least(0.0, strict=False),
        metavar="EPOCHS",
        help="warm-up of the K-FAC run (unset: --warmup-epochs if given, else the warm-up the "
        "suite selected for the task's K-FAC arm, else the task's)",
    )


def _add_environment_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and how the run executes (threads, device, data, output, torchrun)."""
    run = parser.add_argument_group("environment")
    run.add_argument(
        "--device", choices=distributed.DEVICES, default="auto", help="auto: cuda if available"
    )
    run.add_argument(
        "--threads", type=positive_int, help="torch CPU threads (default: leave as is)"
    )
    run.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc thresholds as they are (default: raise them so CPU steps "
        "stop faulting freed memory back in; kaisa.allocator)",
    )
    run.add_argument(
        "--compile-baselines",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile heavyball's soap and shampoo with torch.compile, as heavyball does by "
        "default (the compilation falls in the untimed warm-up; default: on). "
        "--no-compile-baselines runs them eager: same math, no minutes of compiling",
    )
    run.add_argument(
        "--compile-model",
        nargs="?",
        const="inductor",
        choices=BACKENDS,
        help="compile every arm's model with torch.compile under this backend (default "
        "inductor), K-FAC attached first: its statistics formed inside the graphs; each run "
        "compiles on its own model in steps taken before its clock, then restored "
        "(default: eager)",
    )
    run.add_argument("--data-dir", type=Path, help="folder with the task's data (cifar10)")
    run.add_argument(
        "--out", type=output_folder, help="output folder (default: runs/<task>-<timestamp>)"
    )
    run.add_argument("--quiet", action="store_true", help="no progress bars; one line per epoch")
    run.add_argument(
        "--backend",
        choices=distributed.BACKENDS,
        help="torch.distributed backend under torchrun (default: nccl on cuda, else gloo)",
    )
    run.add_argument(
        "--pg-timeout-s",
        type=float_at_least(0.0, strict=True),
        default=300.0,
        help="process-group timeout in seconds under torchrun (default 300)",
    )
    add_kfac_arguments(parser)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its subcommand parsers (for subcommand-specific errors)."""
    parser = argparse.ArgumentParser(
        prog="kaisa",
        description="Train built-in tasks with and without the KAISA K-FAC preconditioner.",
    )
    parser.add_argument("--version", action="version", version=f"kaisa {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="{train,compare,plan,bench}", required=True
    )
    train = commands.add_parser(
        "train",
        help="train one configuration",
        description="Train one configuration; writes results.json and results.png.",
    )
    train.add_argument(
        "--kfac",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="precondition gradients with K-FAC (default: on)",
    )
    compare = commands.add_parser(
        "compare",
        help="train the optimizer with and without K-FAC and compare time to target",
        description=(
            "Train the first-order optimizer and the same optimizer with K-FAC (same seed, "
            "batch size, initial weights and data order) and report time, steps and epochs "
            "to the target metric; with --optimizers, every optimizer named and its K-FAC "
            "run. Times exclude evaluation. With --seeds N, every arm is "
            "trained on N seeds and the table gives median [min-max] per run."
        ),
    )
    for sub in (train, compare):
        _add_common_arguments(sub)
    compare.add_argument(
        "--optimizers",
        type=_optimizer_list,
        metavar="NAME,NAME,...",
        help="compare several optimizers (instead of --optimizer), e.g. adamw,muon,soap: "
        "each is an arm at the task's lr, weight decay and schedule for it, followed by its "
        "K-FAC arm where K-FAC runs on top of it (not soap, shampoo); the first is the "
        "baseline of the time ratios",
    )
    plan = add_plan_parser(commands)
    bench = add_bench_parser(commands)
    return parser, {"train": train, "compare": compare, "plan": plan, "bench": bench}


def _default_out(task: str) -> Path:
    return Path("runs") / f"{task}-{time.strftime('%Y%m%d-%H%M%S')}"


def _write_outputs(
    arms: list[list[RunResult]],
    ctx: distributed.DistContext,
    out: Path,
    allocator: str,
    load_at_start: float | None,
) -> None:
    """results.json, results.png and the table on stdout (main rank only).

    With one seed the table is today's one row per run; with more, one row of
    medians and spreads per arm. The machine's load at the start and the end
    goes into both, since every time depends on it.
    """
    environment = {
        "device": str(ctx.device),
        "world_size": ctx.world_size,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"start": load_at_start, "end": load_average()},
        "allocator": allocator,
        "torch": torch.__version__,
        "kaisa": __version__,
    }
    runs = arms_to_dicts(arms, environment)
    write_results(out / RESULTS_JSON, runs)
    plot_runs(runs, out / RESULTS_PNG)
    several_seeds = any(len(arm) > 1 for arm in arms)
    print(format_seed_table(runs) if several_seeds else format_table(runs), flush=True)
    print(format_environment(environment), flush=True)
    print(f"wrote {out / RESULTS_JSON} and {out / RESULTS_PNG}", flush=True)


def _check_optimizers(specs: Sequence[RunSpec], error: Any, flag: str) -> None:
    """Refuse (``error``) an optimizer whose package is missing; warn about untuned lrs.

    Both before any training, so a long comparison does not fail at its third arm.
    """
    for spec in specs:
        try:
            check_available(spec.optimizer)
        except OptionalDependencyError as err:
            error(f"argument {flag}: {err}")
        if not spec.lr_tuned:
            print(
                f"note: {spec.name} runs at lr {spec.lr:g}, not tuned for {spec.task} by the "
                "benchmark suite (kaisa bench run); set it with --lr",
                file=sys.stderr,
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kaisa`` console script and of ``python -m kaisa``.

    Every usage problem (bad option, inconsistent K-FAC options, missing data,
    missing device) is reported before any training starts, as an argparse
    error naming the option (exit status 2).
    """
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    command = commands[args.command]
    if args.command == "plan":
        return run_plan(args, command.error)
    if args.command == "bench":
        return run_bench(args, command.error)
    task = get_task(args.task)
    try:
        specs = build_specs(args, task, [args.kfac] if args.command == "train" else [False, True])
    except (ScheduleError, OptimizerError) as err:
        command.error(str(err))
    except (TypeError, ValueError) as err:
        command.error(f"invalid K-FAC options: {err}")
    several = getattr(args, "optimizers", None) is not None
    _check_optimizers(specs, command.error, "--optimizers" if several else "--optimizer")
    try:
        data = task.load(args.data_dir)
    except FileNotFoundError as err:
        command.error(f"argument --data-dir: {err}")
    except ValueError as err:  # a file of --data-dir that is not in the task's format
        if args.data_dir is None:
            raise
        command.error(f"argument --data-dir: {err}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tuned = not args.default_allocator and tune_cpu_allocator()
    allocator = "glibc, thresholds raised" if tuned else "default"
    try:
        ctx = distributed.init(args.device, args.backend, args.pg_timeout_s)
    except distributed.DeviceError as err:
        command.error(f"argument --device: {err}")
    for spec in specs:
        if not spec.kfac or spec.kfac_config().grad_worker_fraction is DistributedStrategy.AUTO:
            continue
        try:  # fractions are only valid or not for a given world size
            grad_workers_for(spec.kfac_config().grad_worker_fraction, ctx.world_size)
        except ValueError as err:
            distributed.shutdown(ctx)
            command.error(f"argument --kfac-grad-worker-fraction: {err}")
    try:
        progress = Progress(enabled=ctx.is_main, bars=not args.quiet)
        load_at_start = load_average()
        warm_up(specs, task, data, ctx)
        arms = run_seeds(specs, args.seeds, task, data, ctx, progress)
        if ctx.is_main:
            _write_outputs(arms, ctx, args.out or _default_out(task.name), allocator, load_at_start)
    finally:
        distributed.shutdown(ctx)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
