"""Time to target on W data-parallel ranks, forecast from the steps the suite
measured at each global batch.

A data-parallel job keeps its per-rank batch ``b`` and grows the global batch
with the ranks: on W ranks it trains at ``W·b``. The large-batch study's
cases (``text-lm`` at 32, ``text-lm-b128``, ``text-lm-b512``) measure each
arm's steps to target at those global batches under the tuning protocol; this
case turns them into time on ``W = B / b`` ranks, for each per-rank batch
``b`` given (2: batch 32, 128, 512 on 16, 64, 256 ranks; 8: on 4, 16, 64):

    time(W) = steps(B) × (step on one rank at batch b + what W ranks add)

- **steps(B)**: the median over the case's held-out seeds at the arm's
  selected setting (a seed that missed the target counts as never), from
  the campaign's records; a batch whose arm is not held out yet is not
  forecast (its row says so);
- **the step on one rank**: measured here, every arm at the per-rank batch
  with its selected K-FAC knobs, interleaved (:func:`kaisa_lab.bench.timer.
  interleave`) on the same batches, on the device named in the record
  (``--device cuda``: on the GPU, synchronised);
- **what W ranks add** (modelled by the planner's cost model with the given
  links): the gradients' all-reduce every step (DDP's buckets of 25 MB, one
  collective each) and, for a K-FAC arm, its collectives amortised over its
  intervals — factors reduced to their owners, second-order broadcasts, the
  preconditioned gradients under MEM/HYBRID-OPT (:func:`kaisa.planner.
  forecast.forecast`'s ``factor_comm``, ``inverse_comm``, ``grad_comm``).
  Decompositions spread over the owners on W ranks, so the one-rank step is
  an upper bound on a K-FAC arm's compute.

The table gives each arm's forecast per W, the best first-order arm's, and
the crossover: the least W at which a K-FAC arm's forecast is below every
first-order arm's. The plot draws steps against batch and the forecast time
against W.

    kaisa bench run large-batch-forecast                 # the step measured on this CPU
    kaisa bench run large-batch-forecast --device cuda   # ... on this GPU
    kaisa bench report large-batch-forecast --table forecast --plot docs/reports/large-batch.png
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import forecast, layer_costs
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.costs.plan_paper import Links, gpu_costs
from kaisa_lab.bench.costs.task_steps import TaskArm, task_batches
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import TIE
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = ["CASE", "comm_seconds", "crossover", "heldout_steps"]

#: K-FAC's collectives, of the planner's stages
COMM_STAGES = ("factor_comm", "inverse_comm", "grad_comm")
#: DDP's default gradient bucket
BUCKET_BYTES = 25 * 2**20


def heldout_steps(campaign: Campaign) -> dict[str, tuple[float, Mapping[str, Any]] | None]:
    """Per arm: (median held-out steps to target, a miss counting as never; the
    selected K-FAC knobs), or None while the arm is not held out on every seed."""
    seeds = campaign.protocol.heldout_seeds
    out: dict[str, tuple[float, Mapping[str, Any]] | None] = {}
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        records = [] if state.selected is None else campaign.records(arm, state.selected, seeds)
        if state.selected is None or len(records) < len(seeds):
            out[arm.name] = None
            continue
        steps = [
            float(r["result"]["steps_to_target"]) if r["result"]["reached"] else math.inf
            for r in records
        ]
        out[arm.name] = (statistics.median(steps), dict(state.selected.kfac))
    return out


def comm_seconds(
    model: nn.Module, world: int, cost: CostModel, kfac: Mapping[str, Any] | None
) -> dict[str, float]:
    """Seconds per step that ``world`` ranks add to one rank's step: DDP's
    gradient all-reduce and, with ``kfac`` (preconditioner keywords), K-FAC's
    collectives amortised over its intervals (the slowest rank's)."""
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    calls = max(1, math.ceil(grad_bytes / BUCKET_BYTES))
    out = {"allreduce": cost.collective(grad_bytes, world, calls, allreduce=True)}
    if kfac is not None:
        layers = layer_costs(model, device="cuda", **kfac)
        plan = forecast(layers, world, cost, **kfac)
        for stage in COMM_STAGES:
            out[stage] = float(plan.seconds[stage].max()) if stage in plan.seconds else 0.0
    return out


def crossover(
    times: Mapping[int, Mapping[str, float]], kfac_arms: Sequence[str], peers: Sequence[str]
) -> tuple[int, str] | None:
    """The least W at which some K-FAC arm's forecast beats every peer's by more
    than a tie (:data:`kaisa_lab.bench.report.TIE`), and that arm."""
    for world in sorted(times):
        row = times[world]
        rivals = [row[p] for p in peers if p in row]
        ours = {a: row[a] for a in kfac_arms if a in row}
        if not rivals or not ours:
            continue
        arm = min(ours, key=ours.__getitem__)
        if ours[arm] < (1 - TIE) * min(rivals):
            return world, arm
    return None


def _cost(options: Mapping[str, Any]) -> CostModel:
    """The links' cost model (only its collectives are used: the compute is measured)."""
    links = Links(**options["links"])
    return replace(gpu_costs(links, options["tflops"]), device=f"given: {options['kind']}")


#: one arm at one global batch: (case, batch, arm, held-out steps, selected knobs)
Found = tuple[str, int, str, float | None, Mapping[str, Any] | None]


def _found(options: Mapping[str, Any], store: RecordStore) -> tuple[str, list[Found]]:
    """The task the cases share, and every arm of every case with its held-out steps."""
    from kaisa_lab.tasks import get_task

    found: list[Found] = []
    task_name = None
    for case_name in options["cases"]:
        case = get_case(case_name)
        task_name = task_name or case.task
        if case.task != task_name:
            raise ValueError(f"cases: {case_name} is on {case.task}, the others on {task_name}")
        batch = case.batch_size or get_task(case.task).defaults.batch_size
        for b in options["per_rank_batch"]:
            if batch % b:
                raise ValueError(f"per_rank_batch {b} does not divide {case_name}'s batch {batch}")
        for name, held in heldout_steps(Campaign(case, store)).items():
            if options["arms"] and name not in options["arms"]:
                continue
            steps, knobs = (None, None) if held is None else held
            found.append((case_name, batch, name, steps, knobs))
    assert task_name is not None
    return task_name, found


def _keywords(task: Any, name: str, knobs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A K-FAC arm's preconditioner keywords at its selected knobs (None: no K-FAC)."""
    return {"loss_average": task.loss_average, **(knobs or {})} if "+kfac" in name else None


#: the clock of a step on a CPU at one torch thread: the process's CPU time,
#: which the machine's other work does not lengthen (a rank of the forecast
#: runs alone), where the wall clock moved 2x between two measurements
#: taken under a campaign's load
CPU_CLOCK = "process CPU time"


def step_clock(device: str) -> str:
    """Which clock times a step: CPU time on a CPU at one thread, else the wall clock."""
    on_cpu = not str(device).startswith("cuda")
    return CPU_CLOCK if on_cpu and torch.get_num_threads() == 1 else "wall clock"


def _step_ms(
    task: Any, found: Sequence[Found], b: int, options: Mapping[str, Any]
) -> dict[str, float]:
    """Each held-out arm's mean step (ms) at batch ``b`` on the device, interleaved."""
    data = task.load()
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))
    device = options["device"]
    batches = [
        (x.to(device), y.to(device))
        for x, y in task_batches(data, order, b, (options["rounds"] + 1) * options["block"])
    ]
    built: dict[str, TaskArm] = {}
    for _case, batch, name, steps, knobs in found:
        if steps is not None:
            optimizer = name.split("+")[0].split(" ")[0]
            arm = f"{optimizer}+kfac" if "+kfac" in name else optimizer
            keywords = _keywords(task, name, knobs)
            built[f"{name} @ {batch}"] = TaskArm(task, arm, keywords, batches, device)
    if not built:
        return {}
    for _ in range(options["block"]):  # a warm turn (lazy set-up, first decompositions)
        for each in built.values():
            each()
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else None
    timed = interleave(
        built,
        rounds=options["rounds"],
        block=options["block"],
        warmup=0,
        sync=sync,
        clock=time.process_time if step_clock(device) == CPU_CLOCK else time.perf_counter,
    )
    return {label: t.summary()["mean_ms"] for label, t in timed.items()}


def measure(options: Mapping[str, Any]) -> list[Row]:
    from kaisa_lab.tasks import get_task

    cost = _cost(options)
    task_name, found = _found(options, RecordStore(Path(options["records"])))
    task = get_task(task_name)
    torch.manual_seed(0)
    model = task.build_model()
    rows = []
    for b in options["per_rank_batch"]:
        step_ms = _step_ms(task, found, b, options)
        for case_name, batch, name, steps, knobs in found:
            world = batch // b
            config: dict[str, Any] = {
                "task": task_name,
                "case": case_name,
                "arm": name,
                "batch": batch,
                "per_rank_batch": b,
                "world": world,
                "kfac": _keywords(task, name, knobs),
                "cost_model": asdict(cost),
                "clock": step_clock(options["device"]),
            }
            ms = step_ms.get(f"{name} @ {batch}")
            result: dict[str, Any] = {"steps": steps, "measured": ms is not None}
            if ms is not None and steps is not None:
                comm = comm_seconds(model, world, cost, _keywords(task, name, knobs))
                step_s = ms / 1e3 + sum(comm.values())
                result.update(
                    step_ms=ms,
                    comm_ms={k: 1e3 * v for k, v in comm.items()},
                    forecast_s=None if math.isinf(steps) else steps * step_s,
                )
            rows.append(Row(f"{name} @ {batch} (W={world})", config, result))
    return rows


def _by_world(records: Records) -> dict[tuple[int, int], dict[str, Mapping[str, Any]]]:
    """Records by (per-rank batch, W), each group's arms in the order the run's
    options name them."""
    order = list(records[0]["config"].get("options", {}).get("arms") or []) if records else []
    rank = {name: i for i, name in enumerate(order)}
    out: dict[tuple[int, int], dict[str, Mapping[str, Any]]] = {}
    for r in sorted(records, key=lambda r: rank.get(r["config"]["arm"], len(rank))):
        c = r["config"]
        out.setdefault((c["per_rank_batch"], c["world"]), {})[c["arm"]] = r
    return out


def forecast_table(records: Records) -> str:
    if not records:
        return "No records yet: `kaisa bench run large-batch-forecast`."
    lines = [
        "| per-rank batch | global batch | ranks W | arm | held-out steps "
        "| step on one rank (ms) | W ranks add (ms) | forecast time (s) | vs best first-order |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    times: dict[int, dict[int, dict[str, float]]] = {}
    kfac_arms: set[str] = set()
    peers: set[str] = set()
    for (b, world), arms in sorted(_by_world(records).items()):
        firsts = [
            r["result"]["forecast_s"]
            for name, r in arms.items()
            if "+kfac" not in name and r["result"].get("forecast_s") is not None
        ]
        best = min(firsts) if firsts else None
        for name, r in arms.items():
            res, c = r["result"], r["config"]
            (kfac_arms if "+kfac" in name else peers).add(name)
            head = f"| {b} | {c['batch']} | {world} | {name} |"
            if not res["measured"]:
                lines.append(f"{head} not held out yet | | | | |")
                continue
            t = res["forecast_s"]
            if t is not None:
                times.setdefault(b, {}).setdefault(world, {})[name] = t
            ratio = f"{t / best:.2f}" if t is not None and best else "-"
            steps = "never" if math.isinf(res["steps"]) else f"{res['steps']:g}"
            lines.append(
                f"{head} {steps} | {res['step_ms']:.1f} | {sum(res['comm_ms'].values()):.2f} | "
                f"{'-' if t is None else f'{t:.1f}'} | {ratio} |"
            )
    env = records[0]["environment"]
    m = env["machine"]
    where = f"{m['gpu'] or m['cpu']} ({m['cpus']} CPUs, {env['threads']} torch thread(s))"
    lines.append("")
    clock = records[0]["config"].get("clock", "wall clock")
    lines.append(
        f"Step measured on {where} ({clock}); "
        f"links: {records[0]['config']['cost_model']['device']}."
    )
    for b in sorted({r["config"]["per_rank_batch"] for r in records}):
        cross = crossover(times.get(b, {}), sorted(kfac_arms), sorted(peers))
        lines.append(
            f"Per-rank batch {b}: "
            + (
                f"{cross[1]} is forecast faster than every first-order arm (by more than "
                f"{TIE:.0%}) from W = {cross[0]}."
                if cross
                else f"no K-FAC arm is forecast faster than every first-order arm by more "
                f"than {TIE:.0%} at any W measured."
            )
        )
    return "\n".join(lines)


def plot(records: Records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    lines: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in records:
        if r["result"]["measured"] and r["result"]["forecast_s"] is not None:
            lines.setdefault((r["config"]["arm"], r["config"]["per_rank_batch"]), []).append(r)
    first_b = min((b for _, b in lines), default=None)
    markers = dict(zip(sorted({b for _, b in lines}), "osD^v"))
    colours = {name: f"C{i}" for i, name in enumerate(sorted({n for n, _ in lines}))}
    for (name, b), rs in sorted(lines.items()):
        rs = sorted(rs, key=lambda r: r["config"]["batch"])
        style = {
            "color": colours[name],
            "marker": markers[b],
            "linestyle": "-" if "+kfac" in name else "--",
        }
        if b == first_b:  # the steps do not depend on the per-rank batch
            batches = [r["config"]["batch"] for r in rs]
            left.plot(batches, [r["result"]["steps"] for r in rs], label=name, **style)
        worlds = [r["config"]["world"] for r in rs]
        times = [r["result"]["forecast_s"] for r in rs]
        right.plot(worlds, times, label=f"{name}, {b} per rank", **style)
    for ax, (x, y) in (
        (left, ("global batch", "held-out steps to target")),
        (right, ("ranks W (per-rank batch fixed)", "forecast time to target (s)")),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="large-batch-forecast",
        description="time to target on W ranks at a fixed per-rank batch: held-out steps at "
        "each global batch × the step on one rank, measured, + the links' collectives, modelled",
        measure=measure,
        options={
            "cases": ["text-lm", "text-lm-b128", "text-lm-b512"],
            "arms": ["adamw", "muon", "adamw+kfac", "muon+kfac", "muon+kfac tuned"],
            "records": "benchmarks/records",
            # 2: batch 32, 128, 512 on 16, 64, 256 ranks; 4: on 8, 32, 128; 8: on 4, 16, 64
            "per_rank_batch": [2, 4, 8],
            # H100 nodes of 8: NVLink inside, 400 Gb/s InfiniBand per GPU between
            "links": {
                "gpus_per_node": 8,
                "link_gbit": 400.0,
                "intra_gbit": 3600.0,
                "intra_latency_us": 3.0,
            },
            "kind": "H100 nodes of 8, NVLink inside (3600 Gb/s per GPU), 400 Gb/s "
            "InfiniBand per GPU between",
            "tflops": 100.0,
            # 300 steps an arm: three decompositions at the defaults, and a mean
            # that two measurements under a campaign's load agree on within a few %
            "rounds": 30,
            "block": 10,
            "device": "cpu",
        },
        quick={"cases": ["text-lm"], "per_rank_batch": [2], "rounds": 1, "block": 2},
        tables={"forecast": forecast_table},
        plot=plot,
        in_make_bench=False,
        device="any",
    )
)
