"""``kaisa plan``: memory, traffic and time of every strategy before a run.

For a model (a built-in task or ``module:callable``), world sizes and a cost
model, print per grad_worker_fraction the K-FAC memory per rank, the bytes
each rank moves per step (averaged, and on factor and inverse steps), the
predicted overhead per step, and which fraction to use under a memory
budget.  With ``--out``, also writes ``plan.json`` and ``plan.png`` there
(memory against bytes per step, one line per world size, as Fig. 6.3 of the
SC'21 paper).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisa.config import KFACConfig
from kaisa.layers.registry import supported_layers
from kaisa.planner.costs import CostModel, measure_costs
from kaisa.planner.forecast import choose_fraction, layer_costs
from kaisa.planner.probe import probe_rows
from kaisa_lab.cli.options import (
    add_kfac_arguments,
    float_at_least,
    kfac_overrides,
    output_folder,
    positive_int,
)
from kaisa_lab.tasks import get_task, task_names

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
    plan.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        metavar="W",
        help="data-parallel world sizes to plan for, one or more (default: 1 2 4)",
    )
    plan.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="per-rank (micro-)batch (default: the task's; 32)",
    )
    plan.add_argument(
        "--memory-budget-mib",
        type=float_at_least(0.0, strict=True),
        default=None,
        help="K-FAC memory allowed per rank (MiB)",
    )
    costs = plan.add_mutually_exclusive_group()
    costs.add_argument("--costs", type=Path, help="a cost model JSON (from --save-costs)")
    costs.add_argument(
        "--measure-costs",
        choices=["cpu", "cuda"],
        help="time eigh, Cholesky inverse and matmul on this device first",
    )
    plan.add_argument(
        "--save-costs",
        type=Path,
        metavar="FILE",
        help="write the cost model used as JSON (its folder is created)",
    )
    plan.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the run's layers live: the CPU workspace (three buffers the size of the "
        "largest gradient, kaisa.core.workspace) is counted on cpu only (default: the device of "
        "--measure-costs, else where the model is built: the CPU for --task)",
    )
    plan.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        help="link speed per rank in gigabits per second, as links are rated (100 = 12.5 GB/s)",
    )
    plan.add_argument(
        "--latency-us", type=float, default=None, help="µs per collective hop (between nodes)"
    )
    _add_node_arguments(plan)
    plan.add_argument(
        "--out",
        type=output_folder,
        default=None,
        help="a folder to write plan.json and plan.png into (default: print only)",
    )
    add_kfac_arguments(plan)
    return plan


def _add_node_arguments(plan: argparse.ArgumentParser) -> None:
    """The two-level link's options (ranks per node, the intra-node link)."""
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
    if module_name == "kaisa.zoo":  # the zoo's home before kaisa-lab split off
        raise ValueError(f"the model zoo is kaisa_lab.zoo now: --model kaisa_lab.zoo:{attr}")
    factory = getattr(importlib.import_module(module_name), attr)
    if not callable(factory):
        raise ValueError(f"{args.model} is a {type(factory).__name__}, not a callable")
    try:
        inspect.signature(factory).bind()
    except TypeError as exc:  # it is called with no arguments: say which it needs
        raise ValueError(f"{args.model} is called with no arguments, but {exc}") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    built = factory()
    if isinstance(built, nn.Module):
        return built, None, args.batch_size or 32
    if (
        not isinstance(built, (tuple, list))
        or len(built) != 2
        or not isinstance(built[0], nn.Module)
    ):
        raise ValueError(
            f"{args.model}() returned a {type(built).__name__}; expected an nn.Module "
            f"or (model, example inputs of batch 1)"
        )
    model, example = built
    example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    return model, example, args.batch_size or 32


def _cost_model(args: argparse.Namespace, error: Any) -> CostModel:
    """The cost model of --costs / --measure-costs / the defaults, with the
    link options that are given on top (the file's figures otherwise);
    every failure names the option it comes from."""

    def scaled(value: float | None, factor: float) -> float | None:
        return value * factor if value is not None else None

    cost = CostModel()
    if args.costs:
        try:
            cost = CostModel.load(args.costs)
        except (ValueError, TypeError, OSError) as exc:
            error(f"argument --costs: {exc}")
    elif args.measure_costs:
        try:
            cost = measure_costs(args.measure_costs)
        except (RuntimeError, AssertionError) as exc:
            error(f"argument --measure-costs: cannot time kernels on {args.measure_costs}: {exc}")
    try:
        # the cost model counts bytes and seconds; links are rated in bits, hops in µs
        cost = cost.with_link(
            scaled(args.bandwidth_gbps, 1e9 / 8),
            scaled(args.latency_us, 1e-6),
            ranks_per_node=args.ranks_per_node,
            intra_bandwidth=scaled(args.intra_node_bandwidth_gbps, 1e9 / 8),
            intra_latency=scaled(args.intra_node_latency_us, 1e-6),
        )
    except ValueError as exc:
        error(f"argument --bandwidth-gbps/--latency-us/--ranks-per-node/--intra-node-*: {exc}")
    if args.save_costs:
        try:
            args.save_costs.parent.mkdir(parents=True, exist_ok=True)
            cost.save(args.save_costs)
        except OSError as exc:
            error(f"argument --save-costs: cannot write {args.save_costs}: {exc}")
    return cost


def _device(args: argparse.Namespace, error: Any) -> str | None:
    """Where the planned run's layers live (None: where the model was built)."""
    if args.device and args.measure_costs and args.device != args.measure_costs:
        error(
            f"argument --device: {args.device} contradicts --measure-costs "
            f"{args.measure_costs} (the costs are timed where the run will be)"
        )
    return args.device or args.measure_costs


def run_plan(args: argparse.Namespace, error: Any) -> int:
    if any(w < 1 for w in args.world_size):
        error("argument --world-size: every world size must be >= 1")
    task = get_task(args.task) if args.task else None
    kfac = {**(task.kfac_for(task.defaults.optimizer) if task else {}), **kfac_overrides(args)}
    kfac.pop("grad_worker_fraction", None)
    device = _device(args, error)
    cost = _cost_model(args, error)
    try:
        model, example, batch = _load_model(args)
    except (ImportError, AttributeError, ValueError, OSError) as exc:
        error(f"argument --model: {exc}")
    if not layer_costs(model, device=device, **kfac):  # before the probe builds K-FAC
        error(
            f"argument {'--model' if args.model else '--task'}: the model has no layer K-FAC "
            f"can precondition (supported: {supported_layers()}; after --kfac-skip-layers); "
            "nothing to plan"
        )
    rows = probe_rows(model, example, batch / _batch_of(example), **kfac) if example else None
    layers = layer_costs(model, rows, device=device, **kfac)
    budget = args.memory_budget_mib * MIB if args.memory_budget_mib is not None else None
    report: dict[str, Any] = {"cost_model": vars(cost), "batch_size": batch, "plans": []}
    lines = [
        f"{'W':>5} {'fraction':>9} {'workers':>7} {'KFAC MiB':>9} {'MB/step':>9} "
        f"{'MB factor':>9} {'MB inverse':>10} {'overhead ms':>11}  fits"
    ]
    settings: dict[str, Any] = {}
    for world in args.world_size:
        chosen, options = choose_fraction(layers, world, cost, budget, **kfac)
        # what the forecasts used, library defaults included (not what was given)
        settings = {k: options[0].config[k] for k in _SETTINGS}
        for fc in options:
            s = fc.summary(budget)
            s["recommended"] = fc.fraction == chosen
            report["plans"].append(s)
            lines.append(_row(world, fc.fraction, fc.grad_workers, s))
    where = device or _model_device(model)
    report.update(settings=settings, device=where)
    print(
        f"{len(layers)} layers, batch {batch} per rank, {settings}, layers on {where}, "
        f"costs: {cost.device}; links: {cost.describe_links()}"
    )
    print("\n".join(lines))
    limited = [label for la in layers for label in la.limited_labels()]
    report["large_factors"] = limited
    if limited:
        fields = KFACConfig.field_names()
        given = {k: v for k, v in kfac.items() if k in fields}
        limit = KFACConfig.from_options(**given).max_factor_dim
        print(f"factors above max_factor_dim={limit}, not kept dense: {', '.join(limited)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(json.dumps(report, indent=2) + "\n")
        _plot(report["plans"], args.out / "plan.png")
        print(f"wrote {args.out / 'plan.json'} and {args.out / 'plan.png'}")
    return 0


#: the K-FAC settings the header names (as the forecasts saw them)
_SETTINGS = ("factor_update_steps", "inv_update_steps", "compute_method")


def _row(world: int, fraction: float, workers: int, s: dict[str, Any]) -> str:
    """One line of the table (no trailing spaces: the docs quote it verbatim)."""
    line = (
        f"{world:>5} {fraction:>9.4g} {workers:>7} "
        f"{s['memory_max_bytes'] / MIB:>9.1f} {s['bytes_per_step'] / 1e6:>9.2f} "
        f"{s['bytes_factor_step'] / 1e6:>9.2f} {s['bytes_inverse_step'] / 1e6:>10.2f} "
        f"{1e3 * s['overhead_s']:>11.2f}  {'yes' if s['fits'] else 'no':<4}"
        + ("  <- recommended" if s["recommended"] else "")
    )
    return line.rstrip()


def _model_device(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


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
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    worlds = sorted({p["world_size"] for p in plans})
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-")]
    for k, world in enumerate(worlds):
        rows = [p for p in plans if p["world_size"] == world]
        marker, line = styles[k % len(styles)]
        points = [(p["memory_max_bytes"] / MIB, p["bytes_per_step"] / MIB) for p in rows]
        # larger markers first, dashed lines: a line that coincides with another shows
        ax.plot(
            *zip(*points),
            marker=marker,
            linestyle=line,
            markersize=9 - 1.5 * k,
            markerfacecolor="none" if k % 2 else None,
            label=f"W={world}",
        )
        # one label per point, fractions at the same point joined; the lines'
        # labels alternate above and below, apart by line, so lines that meet
        # do not overprint
        at: dict[tuple[float, float], list[str]] = {}
        for (x, y), p in zip(points, rows):
            at.setdefault((round(x, 6), round(y, 6)), []).append(f"{p['grad_worker_fraction']:.3g}")
        for (x, y), fractions in at.items():
            ax.annotate(
                ", ".join(fractions),
                (x, y),
                xytext=(5, 5 + 7 * (k // 2)) if k % 2 == 0 else (5, -11 - 7 * (k // 2)),
                textcoords="offset points",
                fontsize=6,
                color=f"C{k % 10}",
            )
    ax.margins(x=0.08, y=0.18)
    ax.set_xlabel("K-FAC memory per rank (MiB)")
    ax.set_ylabel("MiB sent per step per rank (averaged)")
    ax.set_title("grad_worker_fraction: memory vs communication")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
