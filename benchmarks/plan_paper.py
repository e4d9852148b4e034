"""``kaisa plan`` for the SC'21 paper's models at 8-1024 GPUs, with a given GPU cost model.

ResNet-50 (ImageNet, 224x224, 32 images per GPU) and BERT-Large
(pre-training phase 2: sequences of 512 tokens, 8 per GPU), each at
W = 8 ... 1024 ranks and grad_worker_fraction 1/W (MEM-OPT), 1/8, 1/4, 1/2
(HYBRID-OPT) and 1 (COMM-OPT): per-rank K-FAC memory, bytes per step
(averaged over the update intervals) and per factor and inverse update, the
predicted overhead per step by stage, and the fraction
``grad_worker_fraction='auto'`` would pick (all power-of-two fractions
compared, with and without a memory budget).

Nothing here is measured on a GPU: the cost model is *given* (see
``gpu_costs``: kernel figures representative of a V100/A100), and its links
are a grid of scenarios: ``--gpus-per-node`` ranks per node (0: one level,
every collective at the inter-node figure) with NVLink-class
``--intra-gbit`` inside a node, times ``--link-gbit`` Gb/s per rank between
nodes.  Every scenario's cost model is written next to the results as JSON,
so ``kaisa plan --costs`` reproduces any row.  Memory and bytes do not
depend on the cost model; they are what ``memory_usage()`` and
``comm_stats()`` would report (equal at W = 1, 2, 4 in tests/distributed).

Writes ``plan_paper.json``, ``plan_paper.png`` (memory against bytes per
step, one line per W, as Fig. 6.3 of the SC'21 paper / the thesis),
``plan_paper_scaling.png`` (predicted overhead per step against W, one line
per fraction) and ``plan_paper_fig63.png`` (at W = 64, every power-of-two
fraction: overhead and memory, the layout of the thesis' Fig. 6.3) to
``--out`` (the tables and plots use the first scenario); ``--docs DIR``
copies them under the names docs/planning.md shows.  Prints the tables.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import (
    STAGES,
    Forecast,
    LayerCost,
    choose_fraction,
    forecast,
    fractions_for,
    layer_costs,
)
from kaisa.planner.probe import probe_rows
from kaisa_lab.zoo import bert_large, resnet50

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_paper_tables import memory_table, overhead_table, stages_table

MIB = 2**20
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
#: the world size of the thesis' Fig. 6.3 (64 V100s): every fraction is swept there
FIG63_WORLD = 64
#: factor statistics every 10 steps, decompositions every 100: the defaults of
#: kfac-pytorch's ImageNet example (--kfac-cov-update-freq 10,
#: --kfac-update-freq 100); used for both models
INTERVALS: dict[str, Any] = dict(factor_update_steps=10, inv_update_steps=100)
#: the K-FAC settings planned: those intervals and the eigendecomposition the
#: paper's KAISA (and kfac-pytorch) uses, not kaisa's default (the inverse)
KFAC: dict[str, Any] = dict(**INTERVALS, compute_method="eigen")
#: the runs are on GPUs: no CPU workspace (kaisa.core.workspace) is held
DEVICE = "cuda"


@dataclass(frozen=True)
class PaperModel:
    name: str
    build: Callable[[], tuple[nn.Module, tuple[Any, ...]]]
    batch: int  #: per GPU
    budget_mib: float  #: an example per-rank K-FAC memory budget for 'auto'
    note: str


MODELS = {
    "resnet50": PaperModel("ResNet-50", resnet50, 32, 256.0, "ImageNet 224x224, 32 images per GPU"),
    "bert-large": PaperModel(
        "BERT-Large", bert_large, 8, 2048.0, "phase 2: 512 tokens, 8 sequences per GPU"
    ),
}


@dataclass(frozen=True)
class Links:
    """One link scenario: ranks per node (None: one level) and the figures."""

    gpus_per_node: int | None
    link_gbit: float  #: per rank between nodes (per rank, everywhere, in one level)
    intra_gbit: float  #: per rank inside a node
    intra_latency_us: float

    @property
    def key(self) -> str:
        nodes = f"{self.gpus_per_node}gpn" if self.gpus_per_node else "1level"
        return f"{nodes}_{self.link_gbit:g}gbit"

    @property
    def label(self) -> str:
        if not self.gpus_per_node:
            return f"one level, {self.link_gbit:g} Gb/s"
        return f"{self.gpus_per_node} GPUs/node, {self.link_gbit:g} Gb/s/rank between"


def gpu_costs(links: Links, tflops: float = 14.0) -> CostModel:
    """A GPU-like cost model, given (not measured here; no GPU on this machine).

    * eigh: 5e-12 s·n³ + 5 ms (cuSOLVER syevd in float32: about 10 ms at
      n = 1024 and 0.35 s at n = 4096; its fixed cost is large because the
      tridiagonalisation is partly host-driven);
    * Cholesky inverse: 1e-12 s·n³ + 1 ms;
    * matrix products: ``tflops`` TFLOP/s (14: float32, no TF32: V100 peak 15.7,
      A100 19.5; ``--tflops 100`` for TF32-class products);
    * device memory: 750 GB/s moved (read + write) in a copy;
    * between nodes (or every link, one level): ``links.link_gbit`` Gb/s per
      rank, 10 µs per collective hop;
    * inside a node (two levels): ``links.intra_gbit`` Gb/s per rank and
      ``links.intra_latency_us`` µs per hop.
    """
    two_level = links.gpus_per_node is not None and links.gpus_per_node > 0
    return CostModel(
        eigh_n3=5e-12,
        eigh_fixed=5e-3,
        inverse_n3=1e-12,
        inverse_fixed=1e-3,
        flops=tflops * 1e12,
        memory_bandwidth=750e9,
        bandwidth=links.link_gbit * 1e9 / 8,
        latency=10e-6,
        device=f"given: V100/A100-like, {tflops:g} TFLOP/s products; {links.label}",
        ranks_per_node=links.gpus_per_node if two_level else None,
        intra_bandwidth=links.intra_gbit * 1e9 / 8 if two_level else None,
        intra_latency=links.intra_latency_us * 1e-6 if two_level else None,
    )


def paper_fractions(world: int) -> list[float]:
    """MEM-OPT (1/W), 1/8, 1/4, HYBRID-OPT (1/2) and COMM-OPT (1), once each
    (1/4 and 1/8: the receiver rows are exactly a node of 4 or 8 GPUs)."""
    return sorted({1.0 / world, 1.0 / 8, 0.25, 0.5, 1.0})


def model_layers(model: PaperModel) -> tuple[list[LayerCost], float]:
    """The layers kaisa registers, with the rows one probe step counts, and
    the seconds the probe took (a forward/backward of batch 1 on this CPU)."""
    torch.manual_seed(0)
    start = time.perf_counter()
    net, example = model.build()
    rows = probe_rows(net, example, scale=model.batch)
    layers = layer_costs(net, rows, device=DEVICE, **KFAC)
    return layers, time.perf_counter() - start


def row(model: str, fc: Forecast, recommended: float, within: float, budget: float) -> dict:
    s = fc.summary(budget)
    return {
        "model": model,
        "world_size": fc.world_size,
        "grad_worker_fraction": fc.fraction,
        "grad_workers": fc.grad_workers,
        "memory_mib": s["memory_max_bytes"] / MIB,
        "mb_per_step": s["bytes_per_step"] / 1e6,
        "mb_factor_update": s["bytes_factor_step"] / 1e6,
        "mb_inverse_update": s["bytes_inverse_step"] / 1e6,
        "mb_every_step": s["bytes_every_step"] / 1e6,
        "overhead_ms": 1e3 * s["overhead_s"],
        "stages_ms": {k: 1e3 * v for k, v in s["seconds"].items()},
        "auto": fc.fraction == recommended,
        "auto_within_budget": fc.fraction == within,
    }


def plan_model(
    key: str, layers: list[LayerCost], cost: CostModel, worlds: tuple[int, ...]
) -> tuple[list[dict], dict[int, dict[str, float]]]:
    model = MODELS[key]
    budget = model.budget_mib * MIB
    rows, choices = [], {}
    for world in tqdm(worlds, desc=f"{key} @ {cost.describe_links()}", leave=False):
        free, _ = choose_fraction(layers, world, cost, None, **KFAC)
        within, _ = choose_fraction(layers, world, cost, budget, **KFAC)
        choices[world] = {"auto": free, "auto_within_budget": within}
        for f in paper_fractions(world):
            fc = forecast(layers, world, cost, grad_worker_fraction=f, **KFAC)
            rows.append(row(key, fc, free, within, budget))
    return rows, choices


def fraction_label(f: float, world: int) -> str:
    if f == 1.0:
        return "1"
    return f"1/{round(1 / f)}" if abs(1 / f - round(1 / f)) < 1e-9 else f"{f:.3g}"


def print_table(key: str, rows: list[dict], choices: dict[int, dict[str, float]]) -> None:
    model = MODELS[key]
    print(f"\n{model.name} ({model.note}); {KFAC}, layers on {DEVICE}")
    print(
        f"{'W':>5} {'f':>6} {'KFAC MiB':>9} {'MB/step':>8} {'MB factor':>9} {'MB inverse':>10} "
        f"{'overhead ms':>11}"
    )
    for r in rows:
        w = r["world_size"]
        marks = []
        if r["auto"]:
            marks.append("auto")
        if r["auto_within_budget"]:
            marks.append(f"auto<={model.budget_mib:g}MiB")
        print(
            f"{w:>5} {fraction_label(r['grad_worker_fraction'], w):>6} {r['memory_mib']:>9.1f} "
            f"{r['mb_per_step']:>8.1f} {r['mb_factor_update']:>9.1f} "
            f"{r['mb_inverse_update']:>10.1f} {r['overhead_ms']:>11.1f}  {' '.join(marks)}"
        )
    print(
        "auto picks: "
        + ", ".join(
            f"W={w}: {fraction_label(c['auto'], w)} "
            f"({fraction_label(c['auto_within_budget'], w)} within {model.budget_mib:g} MiB)"
            for w, c in choices.items()
        )
    )


def plot(rows: list[dict], out: Path, links: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        mine = [r for r in rows if r["model"] == key]
        for world in sorted({r["world_size"] for r in mine}):
            line = sorted(
                (r for r in mine if r["world_size"] == world),
                key=lambda r: r["grad_worker_fraction"],
            )
            ax.plot(
                [r["memory_mib"] for r in line],
                [r["mb_per_step"] for r in line],
                marker="o",
                label=f"W={world}",
            )
            for r in line:
                ax.annotate(
                    fraction_label(r["grad_worker_fraction"], world),
                    (r["memory_mib"], r["mb_per_step"]),
                    fontsize=6,
                    xytext=(2, 2),
                    textcoords="offset points",
                )
        ax.set_title(f"{MODELS[key].name}: K-FAC memory vs communication (predicted)", fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("K-FAC memory per rank (MiB, max over ranks; log scale)")
        ax.set_ylabel("MB moved per step per rank (averaged)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plan_paper.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        mine = [r for r in rows if r["model"] == key]
        for label, pick in (
            ("MEM-OPT 1/W", lambda r: r["grad_workers"] == 1),
            ("1/8", lambda r: r["grad_worker_fraction"] == 1 / 8 and r["grad_workers"] > 1),
            ("1/4", lambda r: r["grad_worker_fraction"] == 1 / 4 and r["grad_workers"] > 1),
            ("HYBRID-OPT 1/2", lambda r: r["grad_worker_fraction"] == 0.5),
            ("COMM-OPT 1", lambda r: r["grad_worker_fraction"] == 1.0),
        ):
            line = sorted((r for r in mine if pick(r)), key=lambda r: r["world_size"])
            ax.plot(
                [r["world_size"] for r in line],
                [r["overhead_ms"] for r in line],
                marker="o",
                label=label,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{MODELS[key].name}: predicted K-FAC overhead per step\n{links}", fontsize=10)
        ax.set_xlabel("GPUs (W)")
        ax.set_ylabel("ms per step (amortised)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plan_paper_scaling.png", dpi=120)
    plt.close(fig)


def plot_fig63(sweeps: dict[str, list[dict]], out: Path, links: str) -> None:
    """As the thesis' Fig. 6.3: per fraction at one W, overhead (bars) and memory (line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4), squeeze=False)
    for ax, (key, rows) in zip(axes[0], sweeps.items()):
        labels = [fraction_label(r["grad_worker_fraction"], r["world_size"]) for r in rows]
        ax.bar(range(len(rows)), [r["overhead_ms"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_xlabel(f"grad_worker_fraction at W={rows[0]['world_size']}")
        ax.set_ylabel("predicted K-FAC overhead (ms/step)", color="tab:blue")
        mem = ax.twinx()
        mem.plot(range(len(rows)), [r["memory_mib"] / 1024 for r in rows], "o-", color="tab:red")
        mem.set_ylabel("K-FAC memory per rank (GiB)", color="tab:red")
        ax.set_title(
            f"{MODELS[key].name}: overhead and memory per fraction (predicted)\n{links}",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(out / "plan_paper_fig63.png", dpi=120)
    plt.close(fig)


def print_stages(rows: list[dict], world: int) -> None:
    """Where each fraction's overhead goes at one W (ms per step, amortised)."""
    print(f"stages at W={world} (ms/step): " + " ".join(f"{k:>12}" for k in STAGES))
    for r in rows:
        if r["world_size"] == world:
            label = fraction_label(r["grad_worker_fraction"], world)
            stages = " ".join(f"{r['stages_ms'][k]:>12.2f}" for k in STAGES)
            print(f"{label:>22}: {stages}  = {r['overhead_ms']:.1f}")


def run_scenario(
    key: str, layers: list[LayerCost], links: Links, args: argparse.Namespace, first: bool
) -> tuple[CostModel, list[dict], dict[int, dict[str, float]]]:
    """Plan one model under one link scenario; print the full tables for the first."""
    cost = gpu_costs(links, args.tflops)
    rows, choices = plan_model(key, layers, cost, tuple(args.world_size))
    for r in rows:
        r["links"] = links.key
    if first:
        print(f"\nlinks: {cost.describe_links()}")
        print_table(key, rows, choices)
        print_stages(rows, FIG63_WORLD)
    else:
        print(
            f"{MODELS[key].name}, {cost.describe_links()}: auto picks "
            + ", ".join(f"W={w}: {fraction_label(c['auto'], w)}" for w, c in choices.items())
        )
    return cost, rows, choices


def fig63_sweep(key: str, layers: list[LayerCost], cost: CostModel, auto: float) -> list[dict]:
    """Every power-of-two fraction at the W of the thesis' Fig. 6.3."""
    sweep = [
        row(key, fc, auto, -1.0, 0.0)
        for fc in (
            forecast(layers, FIG63_WORLD, cost, grad_worker_fraction=f, **KFAC)
            for f in fractions_for(FIG63_WORLD)
        )
    ]
    print(
        f"W={FIG63_WORLD}, every fraction: "
        + ", ".join(
            f"{fraction_label(r['grad_worker_fraction'], FIG63_WORLD)}: "
            f"{r['overhead_ms']:.1f} ms {r['memory_mib']:.0f} MiB"
            for r in sweep
        )
    )
    return sweep


#: the outputs, and the names docs/planning.md shows them under (``--docs``)
DOC_NAMES = {
    "plan_paper.json": "plan-paper.json",
    "plan_paper.png": "plan-paper-memory-vs-comm.png",
    "plan_paper_scaling.png": "plan-paper-scaling.png",
    "plan_paper_fig63.png": "plan-paper-fig63.png",
    "plan_paper_costs_4gpn_25gbit.json": "plan-paper-costs.json",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--docs", type=Path, default=None, help="also copy the outputs here")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--world-size", type=int, nargs="+", default=list(WORLDS))
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        nargs="+",
        default=[4, 8, 0],
        help="ranks per node of each scenario (0: one level, every collective at --link-gbit)",
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        nargs="+",
        default=[25.0, 100.0, 200.0],
        help="Gb/s per rank between nodes (25 = a 100 Gb/s NIC shared by 4 GPUs); the tables "
        "and plots use the first, with the first --gpus-per-node",
    )
    parser.add_argument(
        "--intra-gbit", type=float, default=1200.0, help="Gb/s per rank inside a node (NVLink)"
    )
    parser.add_argument("--intra-latency-us", type=float, default=3.0, help="µs per hop inside")
    parser.add_argument(
        "--tflops", type=float, default=14.0, help="matrix-product rate (float32 without TF32: 14)"
    )
    parser.add_argument(
        "--markdown",
        choices=["memory", "overhead", "stages"],
        default=None,
        help="print only this table of docs/planning.md, as markdown, for the one model of "
        "--models (writes nothing); tools/docs_check.py regenerates the docs with it",
    )
    parser.add_argument(
        "--print-costs",
        action="store_true",
        help="print the first scenario's cost model as JSON (docs/plan-paper-costs.json) and stop",
    )
    args = parser.parse_args()
    if args.markdown and len(args.models) != 1:
        parser.error(f"argument --markdown: needs exactly one of --models; got {args.models}")
    return args


def print_markdown(args: argparse.Namespace, scenarios: list[Links]) -> None:
    """One table of docs/planning.md (``--markdown``): the first scenario's
    rows; the overhead table's 'auto' columns group the scenarios by
    ranks per node, one pick per link speed."""
    key = args.models[0]
    layers, _ = model_layers(MODELS[key])
    worlds = tuple(args.world_size)
    cost = gpu_costs(scenarios[0], args.tflops)
    rows, _ = plan_model(key, layers, cost, worlds)
    if args.markdown == "memory":
        lines = memory_table(rows, worlds, FIG63_WORLD)
    elif args.markdown == "stages":
        lines = stages_table(rows, FIG63_WORLD)
    else:
        picks: dict[str, dict[int, list[float]]] = {}
        for links in scenarios:
            name = f"{links.gpus_per_node} per node" if links.gpus_per_node else "one level"
            _, choices = plan_model(key, layers, gpu_costs(links, args.tflops), worlds)
            for w, c in choices.items():
                picks.setdefault(name, {}).setdefault(w, []).append(c["auto"])
        lines = overhead_table(rows, worlds, picks)
    print("\n".join(lines))


def main() -> None:
    args = parse_args()
    scenarios = [
        Links(gpn or None, gbit, args.intra_gbit, args.intra_latency_us)
        for gpn in args.gpus_per_node
        for gbit in args.link_gbit
    ]
    if args.print_costs:
        print(json.dumps(asdict(gpu_costs(scenarios[0], args.tflops)), indent=2))
        return
    if args.markdown:
        print_markdown(args, scenarios)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "intervals": INTERVALS,
        "kfac": KFAC,
        "device": DEVICE,
        "models": {},
        "cost_models": {},
        "rows": [],
        "auto": {},
        "fig63": {},
    }
    for key in tqdm(args.models, desc="models"):
        layers, probe_s = model_layers(MODELS[key])
        report["models"][key] = {
            **{k: v for k, v in asdict(MODELS[key]).items() if k != "build"},
            "layers": len(layers),
            "probe_seconds": probe_s,
        }
        for i, links in enumerate(scenarios):
            cost, rows, choices = run_scenario(key, layers, links, args, first=i == 0)
            costs_path = args.out / f"plan_paper_costs_{links.key}.json"
            cost.save(costs_path)
            report["cost_models"][links.key] = {"file": costs_path.name, **asdict(cost)}
            report["rows"] += rows
            report["auto"][f"{key}@{links.key}"] = {str(w): c for w, c in choices.items()}
            if i == 0:
                auto = choices.get(FIG63_WORLD, {}).get("auto", -1.0)
                report["fig63"][key] = fig63_sweep(key, layers, cost, auto)
    (args.out / "plan_paper.json").write_text(json.dumps(report, indent=2) + "\n")
    first = scenarios[0]
    plot([r for r in report["rows"] if r["links"] == first.key], args.out, first.label)
    plot_fig63(report["fig63"], args.out, first.label)
    print(f"wrote {args.out}: " + ", ".join(DOC_NAMES) + ", plan_paper_costs_*.json")
    if args.docs is not None:
        args.docs.mkdir(parents=True, exist_ok=True)
        for name, doc_name in DOC_NAMES.items():
            if (args.out / name).exists():
                shutil.copyfile(args.out / name, args.docs / doc_name)
        print(f"copied to {args.docs}")


if __name__ == "__main__":
    main()
