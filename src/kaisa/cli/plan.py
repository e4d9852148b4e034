"""``kaisa plan``: memory, traffic and time of every strategy before a run.

For a model (a built-in task or ``module:callable``), world sizes and a cost
model, print per grad_worker_fraction the K-FAC memory per rank, the bytes
each rank moves per step (averaged, and on factor and inverse steps), the
predicted overhead per step, and which fraction to use under a memory
budget.  Writes ``plan.json`` and ``plan.png`` (memory against bytes per
step, one line per world size, as Fig. 6.3 of the SC'21 paper).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisa.cli.options import add_kfac_arguments, kfac_overrides
from kaisa.config import KFACConfig
from kaisa.costs import CostModel, measure_costs
from kaisa.forecast import choose_fraction, layer_costs, probe_rows
from kaisa.tasks import get_task, task_names

MIB = 2**20


def add_plan_parser(commands: Any) -> argparse.ArgumentParser:
    plan = commands.add_parser(
        "plan",
        help="predict memory, communication and step overhead of every grad_worker_fraction",
        description=__doc__.splitlines()[0],
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--task", choices=task_names(), help="a built-in task's model")
    source.add_argument(
        "--model",
        metavar="MODULE:CALLABLE",
        help="a callable returning a model, or (model, example inputs of batch 1)",
    )
    plan.add_argument("--world-size", type=int, nargs="+", default=[1, 2, 4], metavar="W")
    plan.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per-rank (micro-)batch (default: the task's; 32)",
    )
    plan.add_argument(
        "--memory-budget-mib", type=float, default=None, help="K-FAC memory allowed per rank"
    )
    costs = plan.add_mutually_exclusive_group()
    costs.add_argument("--costs", type=Path, help="a cost model JSON (from --save-costs)")
    costs.add_argument(
        "--measure-costs",
        choices=["cpu", "cuda"],
        help="time eigh, Cholesky inverse and matmul on this device first",
    )
    plan.add_argument("--save-costs", type=Path, help="write the cost model used as JSON")
    plan.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="link speed per rank in gigabits per second, as links are rated (100 = 12.5 GB/s)",
    )
    plan.add_argument(
        "--latency-us", type=float, default=None, help="µs per collective hop (between nodes)"
    )
    nodes = plan.add_argument_group(
        "nodes",
        "a two-level link: consecutive ranks share a node; a collective inside one node runs at "
        "the intra-node figures, one spanning nodes adds --bandwidth-gbps between them "
        "(also read from --costs)",
    )
    nodes.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="GPUs (data-parallel ranks) per node; omitted: one level, every collective at "
        "--bandwidth-gbps",
    )
    nodes.add_argument(
        "--intra-node-bandwidth-gbps",
        type=float,
        default=None,
        help="link speed per rank inside a node, Gb/s (NVLink-class: 1200 = 150 GB/s)",
    )
    nodes.add_argument(
        "--intra-node-latency-us",
        type=float,
        default=None,
        help="µs per hop inside a node (default: --latency-us)",
    )
    plan.add_argument("--out", type=Path, default=Path("runs/plan"))
    add_kfac_arguments(plan)
    return plan


def _load_model(args: argparse.Namespace) -> tuple[nn.Module, tuple[Any, ...] | None, int]:
    """The model, an example input (or None) and the batch size planned for."""
    if args.task:
        task = get_task(args.task)
        torch.manual_seed(0)
        data = task.load(None)
        x, _ = data.train.get_batch(torch.arange(1))
        return task.build_model(), (x,), args.batch_size or task.defaults.batch_size
    module_name, _, attr = args.model.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model must be MODULE:CALLABLE; got {args.model!r}")
    built = getattr(importlib.import_module(module_name), attr)()
    if isinstance(built, nn.Module):
        return built, None, args.batch_size or 32
    model, example = built
    return model, tuple(example), args.batch_size or 32


def _cost_model(args: argparse.Namespace) -> CostModel:
    """The cost model of --costs / --measure-costs / the defaults, with the
    link options that are given on top (the file's figures otherwise)."""

    def scaled(value: float | None, factor: float) -> float | None:
        return value * factor if value is not None else None

    if args.costs:
        cost = CostModel.load(args.costs)
    elif args.measure_costs:
        cost = measure_costs(args.measure_costs)
    else:
        cost = CostModel()
    # the cost model counts bytes and seconds; links are rated in bits, hops in µs
    cost = cost.with_link(
        scaled(args.bandwidth_gbps, 1e9 / 8),
        scaled(args.latency_us, 1e-6),
        ranks_per_node=args.ranks_per_node,
        intra_bandwidth=scaled(args.intra_node_bandwidth_gbps, 1e9 / 8),
        intra_latency=scaled(args.intra_node_latency_us, 1e-6),
    )
    if args.save_costs:
        cost.save(args.save_costs)
    return cost


def run_plan(args: argparse.Namespace, error: Any) -> int:
    if any(w < 1 for w in args.world_size):
        error("argument --world-size: every world size must be >= 1")
    kfac = {**(get_task(args.task).defaults.kfac if args.task else {}), **kfac_overrides(args)}
    kfac.pop("grad_worker_fraction", None)
    try:
        cost = _cost_model(args)
    except (ValueError, OSError) as exc:
        error(f"argument --costs/--ranks-per-node/--intra-node-*: {exc}")
    try:
        model, example, batch = _load_model(args)
    except (ImportError, AttributeError, ValueError, OSError) as exc:
        error(f"argument --model: {exc}")
    rows = probe_rows(model, example, batch / _batch_of(example)) if example else None
    layers = layer_costs(model, rows, **kfac)
    budget = args.memory_budget_mib * MIB if args.memory_budget_mib is not None else None
    report: dict[str, Any] = {"cost_model": vars(cost), "batch_size": batch, "plans": []}
    lines = [
        f"{'W':>5} {'fraction':>9} {'workers':>7} {'KFAC MiB':>9} {'MB/step':>9} "
        f"{'MB factor':>9} {'MB inverse':>10} {'overhead ms':>11}  fits"
    ]
    for world in args.world_size:
        chosen, options = choose_fraction(layers, world, cost, budget, **kfac)
        for fc in options:
            s = fc.summary(budget)
            s["recommended"] = fc.fraction == chosen
            report["plans"].append(s)
            lines.append(
                f"{world:>5} {fc.fraction:>9.4g} {fc.grad_workers:>7} "
                f"{s['memory_max_bytes'] / MIB:>9.1f} {s['bytes_per_step'] / 1e6:>9.2f} "
                f"{s['bytes_factor_step'] / 1e6:>9.2f} {s['bytes_inverse_step'] / 1e6:>10.2f} "
                f"{1e3 * s['overhead_s']:>11.2f}  {'yes' if s['fits'] else 'no':<4}"
                + ("  <- recommended" if s["recommended"] else "")
            )
    intervals = {k: kfac.get(k, 1) for k in ("factor_update_steps", "inv_update_steps")}
    print(
        f"{len(layers)} layers, batch {batch} per rank, {intervals}, costs: {cost.device}; "
        f"links: {cost.describe_links()}"
    )
    print("\n".join(lines))
    limited = [label for la in layers for label in la.limited_labels()]
    report["large_factors"] = limited
    if limited:
        fields = KFACConfig.field_names()
        limit = KFACConfig(**{k: v for k, v in kfac.items() if k in fields}).max_factor_dim
        print(f"factors above max_factor_dim={limit}, not kept dense: {', '.join(limited)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report["plans"], args.out / "plan.png")
    print(f"wrote {args.out / 'plan.json'} and {args.out / 'plan.png'}")
    return 0


def _batch_of(example: tuple[Any, ...] | None) -> int:
    first = next(t for t in (example or ()) if isinstance(t, torch.Tensor))
    return int(first.shape[0])


def _plot(plans: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for world in sorted({p["world_size"] for p in plans}):
        rows = [p for p in plans if p["world_size"] == world]
        ax.plot(
            [p["memory_max_bytes"] / MIB for p in rows],
            [p["bytes_per_step"] / 1e6 for p in rows],
            marker="o",
            label=f"W={world}",
        )
        for p in rows:
            ax.annotate(
                f"{p['grad_worker_fraction']:.3g}",
                (p["memory_max_bytes"] / MIB, p["bytes_per_step"] / 1e6),
                fontsize=6,
            )
    ax.set_xlabel("K-FAC memory per rank (MiB)")
    ax.set_ylabel("MB per step per rank (averaged)")
    ax.set_title("grad_worker_fraction: memory vs communication")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
