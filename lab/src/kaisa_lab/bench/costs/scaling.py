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

Two layouts of the optimizers' work over the W ranks (:data:`LAYOUTS`):

- **replicated**: every rank runs its optimizer whole, as DDP with
  ``torch.optim.Muon`` does, and kaisa at its default ``grad_worker_fraction``
  (COMM-OPT: every rank preconditions every layer; the decompositions spread
  over their owners, KAISA's assignment);
- **sharded**: the per-matrix work split: Muon's step for each matrix on one
  rank (largest first to the least loaded, by its Newton–Schulz flops), the
  results all-gathered, as distributed Muon implementations do; K-FAC at the
  ``grad_worker_fraction`` this forecast finds fastest at that W (the
  products on their grad workers, the preconditioned gradients broadcast:
  KAISA's HYBRID/MEM-OPT).

A rank's step in a layout is the step on one rank with each splittable part
(timed inside that step: Muon's step, K-FAC's decompositions and products)
replaced by the busiest rank's share of it: the planner's (modelled busiest
rank over one rank, :func:`kfac_shares`) for K-FAC's parts, the greedy split's
for Muon's (:func:`busiest_share`). Adding each part's busiest share is an
upper bound where different ranks are the busiest for different parts.

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

from kaisa.config import KFACConfig
from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import forecast, fractions_for, layer_costs
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.costs.plan_paper import Links, gpu_costs
from kaisa_lab.bench.costs.task_steps import TaskArm, task_batches
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import TIE
from kaisa_lab.bench.timer import Timing, interleave
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = [
    "CASE",
    "LAYOUTS",
    "busiest_share",
    "comm_seconds",
    "crossover",
    "heldout_steps",
    "kfac_shares",
    "muon_gather_seconds",
    "ns_flops",
    "parts_table",
    "rank_ms",
    "rank_step_ms",
    "timing_passes",
]

#: K-FAC's collectives, of the planner's stages
COMM_STAGES = ("factor_comm", "inverse_comm", "grad_comm")
#: DDP's default gradient bucket
BUCKET_BYTES = 25 * 2**20
#: how W ranks split the optimizers' work (see the module's docstring)
LAYOUTS = ("replicated", "sharded")
#: a K-FAC part timed on one rank, and the planner's stage that models it
KFAC_PARTS = {"decompose": "decompose", "products": "precondition"}


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


def ns_flops(shape: Sequence[int], steps: int) -> float:
    """Muon's Newton–Schulz flops for one ``m × n`` matrix (``m ≤ n`` after its
    transpose): per iteration the Gram ``X Xᵀ`` (2m²n), its quintic update
    (2m³) and the product with ``X`` (2m²n)."""
    m, n = sorted(shape[:2])
    return float(steps * (4 * m * m * n + 2 * m**3))


def busiest_share(costs: Sequence[float], world: int) -> float:
    """The busiest rank's share of the total work when each item goes, largest
    first, to the least-loaded of ``world`` ranks (1.0 on one rank)."""
    total = float(sum(costs))
    if world < 1:
        raise ValueError(f"world must be >= 1; got {world}")
    if total <= 0:
        return 1.0
    loads = [0.0] * world
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads) / total


def kfac_shares(
    model: nn.Module, world: int, cost: CostModel, kfac: Mapping[str, Any]
) -> dict[str, float]:
    """For each K-FAC part (:data:`KFAC_PARTS`): the busiest of ``world`` ranks'
    modelled seconds of its stage over one rank's (1.0 for a stage one rank
    does not spend time on)."""
    layers = layer_costs(model, device="cuda", **kfac)
    one = forecast(layers, 1, cost, **kfac)
    many = forecast(layers, world, cost, **kfac)
    out = {}
    for part, stage in KFAC_PARTS.items():
        alone = float(one.seconds[stage].max()) if stage in one.seconds else 0.0
        busiest = float(many.seconds[stage].max()) if stage in many.seconds else 0.0
        out[part] = busiest / alone if alone > 0 else 1.0
    return out


def muon_gather_seconds(shapes: Sequence[Sequence[int]], world: int, cost: CostModel) -> float:
    """Seconds per step to all-gather the matrices sharded Muon updated (float32),
    one collective per ``world`` matrices."""
    if world <= 1 or not shapes:
        return 0.0
    nbytes = sum(4 * math.prod(s) for s in shapes)
    return cost.collective(nbytes, world, math.ceil(len(shapes) / world))


def rank_step_ms(
    step_ms: float, parts_ms: Mapping[str, float], shares: Mapping[str, float]
) -> float:
    """A rank's step: the step on one rank with each timed part replaced by the
    busiest rank's share of it (a part without a share: all of it)."""
    return step_ms - sum(ms * (1.0 - shares.get(part, 1.0)) for part, ms in parts_ms.items())


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


#: one arm at one global batch: (case, batch, arm, held-out steps, its K-FAC
#: keywords beyond the task's — the selected knobs and its lever's —, its
#: lever's run fields)
Found = tuple[str, int, str, float | None, Mapping[str, Any] | None, Mapping[str, Any]]


def _found(options: Mapping[str, Any], store: RecordStore) -> tuple[str, list[Found]]:
    """The task the cases share, and every arm of every case with its held-out steps."""
    found: list[Found] = []
    task_name = None
    for case_name in options["cases"]:
        case = get_case(case_name)
        task_name = task_name or case.task
        if case.task != task_name:
            raise ValueError(f"cases: {case_name} is on {case.task}, the others on {task_name}")
        batch = case.global_batch
        for b in options["per_rank_batch"]:
            if batch % b:
                raise ValueError(f"per_rank_batch {b} does not divide {case_name}'s batch {batch}")
        for name, held in heldout_steps(Campaign(case, store)).items():
            if options["arms"] and name not in options["arms"]:
                continue
            arm = case.arm(name)
            steps, knobs = (None, None) if held is None else held
            if knobs is not None:
                knobs = {**knobs, **arm.kfac_lever()}
            found.append((case_name, batch, name, steps, knobs, arm.run_lever()))
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
) -> dict[str, dict[str, Any]]:
    """Each held-out arm's mean step (ms) at batch ``b`` on the device,
    interleaved, with its splittable parts (:meth:`TaskArm.parts_ms`) and the
    shapes Muon orthogonalises."""
    data = task.load()
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))
    device = options["device"]
    batches = [
        (x.to(device), y.to(device))
        for x, y in task_batches(data, order, b, (options["rounds"] + 1) * options["block"])
    ]
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else None
    clock = time.process_time if step_clock(device) == CPU_CLOCK else time.perf_counter
    built: dict[str, TaskArm] = {}
    for _case, batch, name, steps, knobs, lever in found:
        if steps is not None:
            optimizer = name.split("+")[0].split(" ")[0]
            arm = f"{optimizer}+kfac" if "+kfac" in name else optimizer
            keywords = _keywords(task, name, knobs)
            built[f"{name} @ {batch}"] = TaskArm(task, arm, keywords, batches, device, lever)
    if not built:
        return {}
    for _ in range(options["block"]):  # a warm turn (lazy set-up, first decompositions)
        for each in built.values():
            each()
    timed: dict[str, Timing] = {}
    for keep, parts in timing_passes(sync):
        for each in built.values():
            if parts:
                each.time_parts(clock, sync)
            else:
                each.reset()
        turns = interleave(
            built,
            rounds=options["rounds"],
            block=options["block"],
            warmup=0,
            sync=sync,
            clock=clock,
        )
        timed = turns if keep else timed
    return {
        label: {
            "step_ms": t.summary()["mean_ms"],
            "parts_ms": built[label].parts_ms(),
            "muon_shapes": built[label].muon_shapes(),
            "ns_steps": built[label].ns_steps(),
        }
        for label, t in timed.items()
    }


def timing_passes(sync: Any) -> list[tuple[bool, bool]]:
    """The turns :func:`_step_ms` takes, each ``(its step times kept, its parts
    timed)``: on a CPU one, the parts read inside the timed steps (a reading
    costs nothing beside a step); on a GPU (``sync`` given) each reading waits
    for the device, so the parts get turns of their own after the timed ones."""
    return [(True, True)] if sync is None else [(True, False), (False, True)]


def _fraction_label(kfac: Mapping[str, Any]) -> str:
    """``grad_worker_fraction`` as a record keeps it: ``0.25``, or a strategy's name."""
    f = kfac.get("grad_worker_fraction", KFACConfig.grad_worker_fraction)
    return f"{f:g}" if isinstance(f, float) else str(getattr(f, "name", f))


def _layout(
    model: nn.Module,
    world: int,
    cost: CostModel,
    kfac: Mapping[str, Any] | None,
    measured: Mapping[str, Any],
    layout: str,
) -> dict[str, Any]:
    """A rank's step in ``layout`` (ms, compute and collectives), the fraction
    K-FAC runs at there (the fastest of :func:`kaisa.planner.forecast.
    fractions_for`, sharded), and the shares it was computed with."""
    shapes = measured["muon_shapes"]
    shares: dict[str, float] = {}
    gather = 0.0
    if shapes and layout == "sharded":
        ns = [ns_flops(s, measured["ns_steps"]) for s in shapes]
        shares["muon"] = busiest_share(ns, world)
        gather = muon_gather_seconds(shapes, world, cost)
    if kfac is None:
        fractions: list[Any] = [None]
    elif layout == "sharded":
        fractions = fractions_for(world)
    else:
        fractions = [kfac.get("grad_worker_fraction")]
    best: dict[str, Any] | None = None
    for f in fractions:
        keywords = None if kfac is None else {**kfac}
        if keywords is not None and f is not None:
            keywords["grad_worker_fraction"] = f
        these = {**shares, **(kfac_shares(model, world, cost, keywords) if keywords else {})}
        comm = comm_seconds(model, world, cost, keywords)
        if gather:
            comm["muon_allgather"] = gather
        compute = rank_step_ms(measured["step_ms"], measured["parts_ms"], these)
        total = compute + 1e3 * sum(comm.values())
        if best is None or total < best["total_ms"]:
            best = {
                "step_ms": compute,
                "comm_ms": {k: 1e3 * v for k, v in comm.items()},
                "total_ms": total,
                "shares": these,
                "grad_worker_fraction": None if keywords is None else _fraction_label(keywords),
            }
    assert best is not None
    return best


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
        for case_name, batch, name, steps, knobs, lever in found:
            world = batch // b
            kfac = _keywords(task, name, knobs)
            config: dict[str, Any] = {
                **({"lever": dict(lever)} if lever else {}),
                "task": task_name,
                "case": case_name,
                "arm": name,
                "batch": batch,
                "per_rank_batch": b,
                "world": world,
                "kfac": kfac,
                "cost_model": asdict(cost),
                "clock": step_clock(options["device"]),
            }
            measured = step_ms.get(f"{name} @ {batch}")
            result: dict[str, Any] = {"steps": steps, "measured": measured is not None}
            if measured is not None and steps is not None:
                result.update(step_ms=measured["step_ms"], parts_ms=measured["parts_ms"])
                result["layouts"] = {}
                for layout in LAYOUTS:
                    plan = _layout(model, world, cost, kfac, measured, layout)
                    total_s = plan.pop("total_ms") / 1e3
                    plan["forecast_s"] = None if math.isinf(steps) else steps * total_s
                    result["layouts"][layout] = plan
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


def rank_ms(layout: Mapping[str, Any]) -> float:
    """A rank's step in a layout: its compute and its collectives (ms)."""
    return float(layout["step_ms"] + sum(layout["comm_ms"].values()))


def forecast_table(records: Records) -> str:
    if not records:
        return "No records yet: `kaisa bench run large-batch-forecast`."
    lines = [
        "| per-rank batch | global batch | ranks W | arm | held-out steps | step on one rank (ms) "
        "| replicated: a rank's step (ms) | forecast (s) | vs best first-order "
        "| sharded: a rank's step (ms) | K-FAC fraction | forecast (s) | vs best first-order |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    times: dict[tuple[str, int], dict[int, dict[str, float]]] = {}
    kfac_arms: set[str] = set()
    peers: set[str] = set()
    for (b, world), arms in sorted(_by_world(records).items()):
        best: dict[str, float | None] = {}
        for layout in LAYOUTS:
            firsts = [
                r["result"]["layouts"][layout]["forecast_s"]
                for name, r in arms.items()
                if "+kfac" not in name
                and r["result"]["measured"]
                and r["result"]["layouts"][layout]["forecast_s"] is not None
            ]
            best[layout] = min(firsts) if firsts else None
        for name, r in arms.items():
            res, c = r["result"], r["config"]
            (kfac_arms if "+kfac" in name else peers).add(name)
            head = f"| {b} | {c['batch']} | {world} | {name} |"
            if not res["measured"]:
                lines.append(f"{head} not held out yet |" + " |" * 8)
                continue
            steps = "never" if math.isinf(res["steps"]) else f"{res['steps']:g}"
            cells = [f" {steps} | {res['step_ms']:.1f} |"]
            for layout in LAYOUTS:
                plan = res["layouts"][layout]
                t = plan["forecast_s"]
                if t is not None:
                    times.setdefault((layout, b), {}).setdefault(world, {})[name] = t
                top = best[layout]
                ratio = f"{t / top:.2f}" if t is not None and top else "-"
                f = plan["grad_worker_fraction"] or "-"
                fraction = "" if layout == "replicated" else f" {f} |"
                cells.append(
                    f" {rank_ms(plan):.1f} |{fraction} {'-' if t is None else f'{t:.1f}'} | "
                    f"{ratio} |"
                )
            lines.append(head + "".join(cells))
    env = records[0]["environment"]
    m = env["machine"]
    where = f"{m['gpu'] or m['cpu']} ({m['cpus']} CPUs, {env['threads']} torch thread(s))"
    lines.append("")
    clock = records[0]["config"].get("clock", "wall clock")
    lines.append(
        f"Step measured on {where} ({clock}); "
        f"links: {records[0]['config']['cost_model']['device']}."
    )
    for layout in LAYOUTS:
        for b in sorted({r["config"]["per_rank_batch"] for r in records}):
            cross = crossover(times.get((layout, b), {}), sorted(kfac_arms), sorted(peers))
            lines.append(
                f"{layout.capitalize()}, per-rank batch {b}: "
                + (
                    f"{cross[1]} is forecast faster than every first-order arm (by more than "
                    f"{TIE:.0%}) from W = {cross[0]}."
                    if cross
                    else f"no K-FAC arm is forecast faster than every first-order arm by more "
                    f"than {TIE:.0%} at any W measured."
                )
            )
    return "\n".join(lines)


def parts_table(records: Records) -> str:
    """Where one rank's step goes, per per-rank batch and arm (at the largest
    global batch the records hold, whose arms include every lever): Muon's
    own step, K-FAC's preconditioning products and decompositions, and the
    rest (forward, backward, the first-order update, K-FAC's statistics).
    A lever that cuts a part can save at most that part's share."""
    if not records:
        return "No records yet: `kaisa bench run large-batch-forecast`."
    top = max(r["config"]["batch"] for r in records)
    lines = [
        "| per-rank batch | arm | step (ms) | Muon's step (ms) | K-FAC's products (ms) "
        "| K-FAC's decompositions (ms) | the rest (ms) | decompositions' share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (b, _world), arms in sorted(_by_world(records).items()):
        for name, r in arms.items():
            res = r["result"]
            if r["config"]["batch"] != top or not res["measured"]:
                continue
            parts = res["parts_ms"]
            rest = res["step_ms"] - sum(parts.values())
            cells = [parts.get(k) for k in ("muon", "products", "decompose")]
            shown = " | ".join("-" if v is None else f"{v:.1f}" for v in cells)
            decompose = parts.get("decompose")
            share = "-" if decompose is None else f"{decompose / res['step_ms']:.1%}"
            lines.append(
                f"| {b} | {name} | {res['step_ms']:.1f} | {shown} | {rest:.1f} | {share} |"
            )
    return "\n".join(lines)


def plot(records: Records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(LAYOUTS), figsize=(15, 4.2), sharey=False)
    steps_ax, layout_axes = axes[0], dict(zip(LAYOUTS, axes[1:]))
    lines: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for r in records:
        if r["result"]["measured"]:
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
            steps_ax.plot(batches, [r["result"]["steps"] for r in rs], label=name, **style)
        for layout, ax in layout_axes.items():
            kept = [r for r in rs if r["result"]["layouts"][layout]["forecast_s"] is not None]
            worlds = [r["config"]["world"] for r in kept]
            times = [r["result"]["layouts"][layout]["forecast_s"] for r in kept]
            ax.plot(worlds, times, **style)
    for b, marker in markers.items():  # the time panels' key: a marker per per-rank batch
        axes[-1].plot([], [], color="grey", marker=marker, linestyle="", label=f"{b} per rank")
    steps_ax.set_title("steps against batch", fontsize=10)
    for layout, ax in layout_axes.items():
        ax.set_title(f"forecast time, optimizers {layout}", fontsize=10)
    for ax, (x, y) in zip(
        axes,
        (
            ("global batch", "held-out steps to target"),
            *((("ranks W (per-rank batch fixed)", "forecast time to target (s)"),) * len(LAYOUTS)),
        ),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(y)
    steps_ax.legend(fontsize=8, title="arm (colour, both panels)", title_fontsize=8)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="large-batch-forecast",
        description="time to target on W ranks at a fixed per-rank batch, the optimizers' work "
        "replicated or sharded over the ranks: held-out steps at each global batch × a rank's "
        "step (measured on one rank, its splittable parts cut to the busiest rank's share) + "
        "the links' collectives, modelled",
        measure=measure,
        options={
            "cases": ["text-lm", "text-lm-b128", "text-lm-b512"],
            "arms": [
                "adamw",
                "muon",
                "adamw+kfac",
                "muon+kfac",
                "muon+kfac tuned",
                "muon+kfac-pos0.125-bf16",
                "muon+kfac-lean-allpos",
                "muon+kfac-ns3-bf16prod",
                "muon+kfac-adamw-part",
            ],
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
        tables={"forecast": forecast_table, "parts": parts_table},
        plot=plot,
        in_make_bench=False,
        device="any",
    )
)
