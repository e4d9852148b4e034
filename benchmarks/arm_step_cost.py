"""Per-step cost of each arm of ``kaisa compare`` on a task, from interleaved steps.

On a shared machine a step's wall time moves with the load, so arms timed one
after another are not comparable.  This builds every arm (model, optimizer
and, for ``+kfac`` arms, the preconditioner at the task's K-FAC settings, or
at the library's defaults with ``--kfac-defaults``, or either updated by
``--kfac-kwargs damping=0.3,inv_update_steps=100``) in one process and runs
them in turns — ``--block`` steps of each arm, then the next arm,
``--rounds`` times — on the task's own batches, so every arm sees the same
load.  A block of 10 steps holds one K-FAC factor update (the
task's interval), and 5 rounds hold one inverse update per K-FAC arm
(every 50 steps), so the mean is the amortised cost of training.

Reported per arm: wall ms per step and CPU ms per step (``time.process_time``;
with one thread that is close to what the step costs on an idle core), each
the median over rounds of the round's mean, and both relative to the first
arm.  Table on stdout; ``--json`` writes every round.

    python benchmarks/arm_step_cost.py --task text-lm-large \\
        --arms adamw muon adamw+kfac muon+kfac --rounds 5 --block 10 --threads 1
    python benchmarks/arm_step_cost.py --task text-lm-large --kfac-defaults \\
        --arms adamw muon soap shampoo lamb adamw+kfac --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def parse_kfac_kwargs(text: str) -> dict[str, Any]:
    """``key=value,key=value`` into :class:`kaisa.KFACConfig` keywords, each value
    parsed as ``kaisa train``'s ``--kfac-<key>`` parses it (``none``, booleans,
    enums), so a typo fails here rather than after minutes of steps."""
    from kaisa_lab.cli.options import kfac_options

    options = {o.field: o for o in kfac_options() if o.nargs is None}
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in options:
            raise argparse.ArgumentTypeError(
                f"--kfac-kwargs: expected KEY=VALUE with KEY one of {', '.join(sorted(options))}; "
                f"got {item!r}"
            )
        out[key] = options[key].parse(value.strip())
    return out


def kfac_keywords(
    task: Any, opt_name: str, library_defaults: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """The preconditioner's keywords: the task's K-FAC settings for ``opt_name``
    (or none, the library's defaults), then ``extra``.  ``loss_average`` stays
    the task's: it says what the task's loss is, it is not a tuning choice."""
    base = {} if library_defaults else task.defaults.kfac_for(opt_name)
    return {"loss_average": task.loss_average, **base, **extra}


def _arm(task: Any, name: str, kfac_kwargs: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """(model, optimizer, preconditioner or None) of arm ``name`` (``opt`` or ``opt+kfac``);
    the preconditioner at ``kfac_kwargs`` (default: the task's K-FAC settings)."""
    from kaisa import KFACPreconditioner
    from kaisa_lab.optim.build import build_optimizer

    opt_name, _, kfac = name.partition("+")
    d = task.defaults
    torch.manual_seed(0)
    model = task.build_model()
    opt = build_optimizer(
        opt_name,
        model,
        lr=d.arm(bool(kfac), opt_name)[0],
        weight_decay=d.decay(opt_name),
        momentum=d.momentum,
        adamw_lr=d.base_lr("adamw"),
        adamw_weight_decay=d.decay("adamw"),
    )
    precond = None
    if kfac:
        keywords = kfac_keywords(task, opt_name, False, {}) if kfac_kwargs is None else kfac_kwargs
        precond = KFACPreconditioner(model, optimizer=opt, **keywords)
    return model, opt, precond


def _steps(task: Any, arm: tuple[Any, Any, Any], batches: list[Any]) -> None:
    model, opt, precond = arm
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        task.loss(model(x), y).backward()
        if precond is not None:
            precond.step()
        opt.step()


def kfac_configs(arms: dict[str, tuple[Any, Any, Any]]) -> dict[str, dict[str, Any]]:
    """Each K-FAC arm's preconditioner configuration as built (what was timed)."""
    out = {}
    for name, (_, _, precond) in arms.items():
        if precond is not None:
            cfg = dataclasses.asdict(precond.config)
            out[name] = json.loads(json.dumps(cfg, default=str))
    return out


def main(argv: list[str] | None = None) -> int:
    from kaisa_lab.tasks import get_task

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="text-lm-large")
    parser.add_argument("--arms", nargs="+", default=["adamw", "muon", "adamw+kfac", "muon+kfac"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--kfac-defaults",
        action="store_true",
        help="build the +kfac arms at the library's K-FAC defaults (KFACConfig), "
        "not the task's settings",
    )
    parser.add_argument(
        "--kfac-kwargs",
        type=parse_kfac_kwargs,
        default={},
        metavar="KEY=VALUE,...",
        help="K-FAC keywords over the task's settings (or the library's defaults), "
        "e.g. damping=0.3,inv_update_steps=100,kl_clip=none",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = get_task(args.task)
    data = task.load()
    bs = task.defaults.batch_size
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(data.train), generator=gen)

    def batches(n: int, start: int) -> list[Any]:
        return [
            data.train.get_batch(order[(start + i) * bs : (start + i + 1) * bs]) for i in range(n)
        ]

    arms = {
        name: _arm(
            task,
            name,
            kfac_keywords(task, name.partition("+")[0], args.kfac_defaults, args.kfac_kwargs),
        )
        for name in args.arms
    }
    for arm in arms.values():
        _steps(task, arm, batches(args.warmup, 0))
    rows: dict[str, dict[str, list[float]]] = {n: {"wall_ms": [], "cpu_ms": []} for n in arms}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        block = batches(args.block, args.warmup + r * args.block)
        for name, arm in arms.items():
            w0, c0 = time.perf_counter(), time.process_time()
            _steps(task, arm, block)
            rows[name]["wall_ms"].append((time.perf_counter() - w0) * 1e3 / args.block)
            rows[name]["cpu_ms"].append((time.process_time() - c0) * 1e3 / args.block)
    load.append(os.getloadavg()[0])
    first = args.arms[0]
    med = {n: {k: statistics.median(v) for k, v in row.items()} for n, row in rows.items()}
    print(f"{args.task}, {args.rounds} rounds x {args.block} steps, 1-min load ", end="")
    print(f"{load[0]:.2f} -> {load[1]:.2f}")
    print(f"{'arm':<12} {'wall ms':>9} {'vs ' + first:>10} {'cpu ms':>9} {'vs ' + first:>10}")
    for n, m in med.items():
        print(
            f"{n:<12} {m['wall_ms']:9.0f} {m['wall_ms'] / med[first]['wall_ms']:10.2f} "
            f"{m['cpu_ms']:9.0f} {m['cpu_ms'] / med[first]['cpu_ms']:10.2f}"
        )
    if args.json:
        out = {"task": args.task, "rounds": args.rounds, "block": args.block,
               "threads": args.threads, "load_1min": load, "median": med,
               "per_round": rows, "kfac_config": kfac_configs(arms)}  # fmt: skip
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
