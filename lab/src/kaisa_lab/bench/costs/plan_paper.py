"""The planner on the SC'21 paper's models at 8-1024 GPUs, with a given GPU cost model.

ResNet-50 (ImageNet, 224×224, 32 images per GPU) and BERT-Large
(pre-training phase 2: sequences of 512 tokens, 8 per GPU), each at
W = 8 … 1024 ranks and ``grad_worker_fraction`` 1/W (MEM-OPT), 1/8, 1/4, 1/2
(HYBRID-OPT) and 1 (COMM-OPT): per-rank K-FAC memory, bytes per step
(averaged over the update intervals) and per factor and inverse update, the
predicted overhead per step by stage, and the fraction
``grad_worker_fraction='auto'`` picks (every fraction of
:func:`kaisa.planner.forecast.fractions_for` compared, with and without a
per-rank memory budget).  At W = 64, the world of the thesis' Fig. 6.3 (64
V100s), every power-of-two fraction is planned too (an arm of its own).

The layers are those kaisa registers, with the rows one probe step (a
forward/backward of batch 1 on this CPU, scaled to the per-GPU batch) counts;
K-FAC settings: factors every 10 steps and decompositions every 100 (the
defaults of kfac-pytorch's ImageNet example, ``--kfac-cov-update-freq 10
--kfac-update-freq 100``), the eigendecomposition (the paper's KAISA and
kfac-pytorch decompose by ``eigh``; kaisa's default is the inverse), layers on
GPUs (no CPU workspace, :mod:`kaisa.core.workspace`).

Nothing here is measured on a GPU: the cost model is *given*
(:func:`gpu_costs`: kernel figures representative of a V100/A100), and its
links are a grid of scenarios: ``gpus_per_node`` ranks per node (0: one
level, every collective at the inter-node figure) with NVLink-class
``intra_gbit`` inside a node, times ``link_gbit`` Gb/s per rank between
nodes.  Every arm's record holds its cost model, so ``kaisa plan --costs``
reproduces any row; the first scenario's is docs/plan-paper-costs.json
(table ``costs``).  Memory and bytes do not depend on the cost model; they
are what ``memory_usage()`` and ``comm_stats()`` report
(tests/distributed/test_forecast_matches_runs.py checks that at W = 1, 2, 4).

One arm per model, link scenario and W; its result lists every fraction's
figures.  Everything is a plan or a modelled time: a re-run reproduces every
number (the tests compare a quick run with the committed records).

Tables (the first scenario's rows; ``MODEL`` is ``resnet50`` or
``bert-large``): ``MODEL-memory`` (MiB per rank and MB per step per W and
fraction, then the MB of an inverse update at W = 64), ``MODEL-overhead``
(predicted ms per step, the least in bold, and the fraction ``'auto'`` picks
in every link scenario, grouped by ranks per node, one pick per link speed),
``MODEL-stages`` (where the time goes at W = 64); rows whose cells are equal
for consecutive W are merged (``64 … 1024``).  The plot (``--plot P.png``)
draws memory against bytes per step, one line per W, as the SC'21 paper's
Fig. 6.3, in ``P.png``; the predicted overhead against W, one line per
fraction, in ``P-scaling.png``; and the thesis' Fig. 6.3 layout (at W = 64,
overhead as bars and memory as a line per fraction) in ``P-fig63.png``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import (
    Forecast,
    LayerCost,
    choose_fraction,
    forecast,
    fractions_for,
    layer_costs,
)
from kaisa.planner.probe import probe_rows
from kaisa_lab.bench.timing import Records, Row, TimingCase, register
from kaisa_lab.zoo import bert_large, resnet50

__all__ = ["CASE", "MODELS", "Links", "gpu_costs"]

MIB = 2**20
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
#: the world size of the thesis' Fig. 6.3 (64 V100s): every fraction is planned there
FIG63_WORLD = 64
#: factor statistics every 10 steps, decompositions every 100, by ``eigh``
KFAC: dict[str, Any] = dict(factor_update_steps=10, inv_update_steps=100, compute_method="eigen")
#: the runs are on GPUs: no CPU workspace (kaisa.core.workspace) is held
DEVICE = "cuda"
#: the arm that plans every fraction at :data:`FIG63_WORLD`
EVERY_FRACTION = "every fraction"


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

    @property
    def group(self) -> str:
        """The overhead table's column of ``'auto'`` picks it belongs to."""
        return f"{self.gpus_per_node} per node" if self.gpus_per_node else "one level"


def scenarios(options: Mapping[str, Any]) -> list[Links]:
    """The link scenarios of ``options``, the first being the tables' and plots'."""
    return [
        Links(
            gpn or None,
            float(gbit),
            float(options["intra_gbit"]),
            float(options["intra_latency_us"]),
        )
        for gpn in options["gpus_per_node"]
        for gbit in options["link_gbit"]
    ]


def gpu_costs(links: Links, tflops: float = 14.0) -> CostModel:
    """A GPU-like cost model, given (not measured):

    * eigh: 5e-12 s·n³ + 5 ms (cuSOLVER syevd in float32: about 10 ms at
      n = 1024 and 0.35 s at n = 4096; its fixed cost is large because the
      tridiagonalisation is partly host-driven);
    * Cholesky inverse: 1e-12 s·n³ + 1 ms;
    * matrix products: ``tflops`` TFLOP/s (14: float32, no TF32: V100 peak 15.7,
      A100 19.5; 100 for TF32-class products);
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


def model_layers(model: PaperModel) -> list[LayerCost]:
    """The layers kaisa registers, with the rows one probe step counts (a
    forward/backward of batch 1 on the CPU, scaled to the per-GPU batch)."""
    torch.manual_seed(0)
    net, example = model.build()
    rows = probe_rows(net, example, scale=model.batch)
    return layer_costs(net, rows, device=DEVICE, **KFAC)


def fraction_figures(fc: Forecast) -> dict[str, Any]:
    """What the tables and plots show of one fraction's forecast."""
    s = fc.summary()
    return {
        "grad_worker_fraction": fc.fraction,
        "grad_workers": fc.grad_workers,
        "memory_mib": s["memory_max_bytes"] / MIB,
        "mb_per_step": s["bytes_per_step"] / 1e6,
        "mb_factor_update": s["bytes_factor_step"] / 1e6,
        "mb_inverse_update": s["bytes_inverse_step"] / 1e6,
        "mb_every_step": s["bytes_every_step"] / 1e6,
        "overhead_ms": 1e3 * s["overhead_s"],
        "stages_ms": {k: 1e3 * v for k, v in s["seconds"].items()},
    }


def _planned(
    layers: list[LayerCost], world: int, cost: CostModel, fractions: Sequence[float], **kfac: Any
) -> list[dict[str, Any]]:
    return [
        fraction_figures(forecast(layers, world, cost, grad_worker_fraction=f, **kfac))
        for f in fractions
    ]


def measure(options: Mapping[str, Any]) -> list[Row]:
    unknown = set(options["models"]) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown models {sorted(unknown)}; choose from {sorted(MODELS)}")
    rows = []
    for key in options["models"]:
        model = MODELS[key]
        layers = model_layers(model)
        budget = model.budget_mib * MIB
        for i, links in enumerate(scenarios(options)):
            cost = gpu_costs(links, options["tflops"])
            config = {
                "model": key,
                "batch": model.batch,
                "budget_mib": model.budget_mib,
                "kfac": KFAC,
                "device": DEVICE,
                "links": links.key,
                "cost_model": asdict(cost),
            }
            for world in options["worlds"]:
                free, _ = choose_fraction(layers, world, cost, None, **KFAC)
                within, _ = choose_fraction(layers, world, cost, budget, **KFAC)
                result = {
                    "layers": len(layers),
                    "auto": free,
                    "auto_within_budget": within,
                    "fractions": _planned(layers, world, cost, paper_fractions(world), **KFAC),
                }
                rows.append(
                    Row(f"{key} {links.key} W={world}", {**config, "world_size": world}, result)
                )
            if i == 0:  # the thesis' Fig. 6.3: every fraction at W = 64
                result = {
                    "layers": len(layers),
                    "fractions": _planned(
                        layers, FIG63_WORLD, cost, fractions_for(FIG63_WORLD), **KFAC
                    ),
                }
                rows.append(
                    Row(
                        f"{key} {links.key} W={FIG63_WORLD} {EVERY_FRACTION}",
                        {**config, "world_size": FIG63_WORLD, "sweep": EVERY_FRACTION},
                        result,
                    )
                )
    return rows


# -- tables ----------------------------------------------------------------------------

#: the columns of the tables: MEM-OPT, 1/8, 1/4, HYBRID-OPT, COMM-OPT
COLUMNS = ("1/W", "1/8", "1/4", "1/2", "1")
#: stage keys of kaisa.planner.forecast.STAGES and the names the table gives them
STAGE_NAMES = {
    "capture": "capture",
    "factor_comm": "factor reduce",
    "factor_fold": "fold",
    "decompose": "decompose",
    "inverse_comm": "inverse bcast",
    "precondition": "precondition",
    "grad_comm": "gradient bcast",
}
SAME_AS_MEM_OPT = "(= 1/W)"


def fraction_label(f: float) -> str:
    if f == 1.0:
        return "1"
    return f"1/{round(1 / f)}" if abs(1 / f - round(1 / f)) < 1e-9 else f"{f:.3g}"


def _first_links(records: Records) -> str:
    return scenarios(records[0]["config"]["options"])[0].key


def _arms(records: Records, model: str, links: str | None = None) -> dict[int, Mapping[str, Any]]:
    """The paper-fraction arms of ``model`` in scenario ``links`` (default: the
    first), by W."""
    links = links or _first_links(records)
    return {
        r["config"]["world_size"]: r
        for r in records
        if r["config"]["model"] == model
        and r["config"]["links"] == links
        and "sweep" not in r["config"]
    }


def _flat(arms: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every fraction's figures of ``arms``, each with its W."""
    return [
        {**f, "world_size": w}
        for w, arm in sorted(arms.items())
        for f in arm["result"]["fractions"]
    ]


def _by_column(
    rows: Sequence[Mapping[str, Any]], world: int
) -> dict[str, Mapping[str, Any] | None]:
    """The rows at ``world`` under their column; None where 1/8 is 1/W (W = 8)."""
    mine = {r["grad_worker_fraction"]: r for r in rows if r["world_size"] == world}
    wanted = {"1/W": 1.0 / world, "1/8": 1 / 8, "1/4": 0.25, "1/2": 0.5, "1": 1.0}
    out: dict[str, Mapping[str, Any] | None] = {}
    for column, f in wanted.items():
        out[column] = None if column != "1/W" and f == 1.0 / world else mine[f]
    return out


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _merged(worlds: Sequence[int], cells: Callable[[int], list[str]]) -> list[list[str]]:
    """One row per run of consecutive W with equal cells, labelled ``first … last``."""
    runs: list[tuple[int, int, list[str]]] = []
    for w in worlds:
        row = cells(w)
        if runs and runs[-1][2] == row:
            runs[-1] = (runs[-1][0], w, row)
        else:
            runs.append((w, w, row))
    return [[str(a) if a == b else f"{a} … {b}", *row] for a, b, row in runs]


def _none(model: str) -> str:
    return f"(no {model} rows in this measurement)\n"


def memory_table(records: Records, model: str) -> str:
    """MiB per rank and MB per step per W and fraction, then an inverse
    update's MB at W = 64 (or the largest W measured below it)."""
    arms = _arms(records, model)
    if not arms:
        return _none(model)
    rows, worlds = _flat(arms), sorted(arms)
    at = FIG63_WORLD if FIG63_WORLD in arms else worlds[-1]

    def cells(w: int) -> list[str]:
        cols = _by_column(rows, w)
        mib = [SAME_AS_MEM_OPT if r is None else f"{r['memory_mib']:.0f}" for r in cols.values()]
        mb = [SAME_AS_MEM_OPT if r is None else f"{r['mb_per_step']:.0f}" for r in cols.values()]
        return mib + mb

    header = ["W", *(f"MiB {c}" for c in COLUMNS), *(f"MB/step {c}" for c in COLUMNS)]
    lines = _table(header, _merged(worlds, cells))
    inverse = ", ".join(
        f"{r['mb_inverse_update']:.0f} ({c})"
        for c, r in _by_column(rows, at).items()
        if r is not None
    )
    return "\n".join([*lines, "", f"MB per inverse update at W = {at}: {inverse}."]) + "\n"


def overhead_table(records: Records, model: str) -> str:
    """Predicted ms per step per W and fraction (the least in bold), and the
    fraction ``'auto'`` picks per group of scenarios (one pick per link speed)."""
    arms = _arms(records, model)
    if not arms:
        return _none(model)
    rows, worlds = _flat(arms), sorted(arms)
    picks: dict[str, dict[int, list[float]]] = {}
    for links in scenarios(records[0]["config"]["options"]):
        for w, arm in _arms(records, model, links.key).items():
            picks.setdefault(links.group, {}).setdefault(w, []).append(arm["result"]["auto"])

    def cells(w: int) -> list[str]:
        cols = _by_column(rows, w)
        best = min(r["overhead_ms"] for r in cols.values() if r is not None)
        ms = []
        for r in cols.values():
            if r is None:
                ms.append(SAME_AS_MEM_OPT)
            else:
                text = f"{r['overhead_ms']:.1f}"
                ms.append(f"**{text}**" if r["overhead_ms"] == best else text)
        auto = [" / ".join(fraction_label(f) for f in group[w]) for group in picks.values()]
        return ms + auto

    header = ["W", *(f"ms {c}" for c in COLUMNS), *(f"auto, {name}" for name in picks)]
    return "\n".join(_table(header, [[str(w), *cells(w)] for w in worlds])) + "\n"


def stages_table(records: Records, model: str) -> str:
    """Where each fraction's overhead goes at W = 64 (ms per step, amortised)."""
    arm = _arms(records, model).get(FIG63_WORLD)
    if arm is None:
        return _none(f"{model} W={FIG63_WORLD}")

    def ms(value: float) -> str:
        return "0" if value == 0 else f"{value:.1f}"

    body = []
    for r in sorted(arm["result"]["fractions"], key=lambda r: r["grad_worker_fraction"]):
        stages = [ms(r["stages_ms"][k]) for k in STAGE_NAMES]
        body.append([fraction_label(r["grad_worker_fraction"]), *stages, ms(r["overhead_ms"])])
    return "\n".join(_table(["f", *STAGE_NAMES.values(), "total"], body)) + "\n"


def costs_table(records: Records) -> str:
    """The first scenario's cost model as JSON (docs/plan-paper-costs.json,
    which ``kaisa plan --costs`` reads)."""
    links = _first_links(records)
    arm = next(r for r in records if r["config"]["links"] == links)
    return json.dumps(asdict(CostModel(**arm["config"]["cost_model"])), indent=2) + "\n"


# -- plots -----------------------------------------------------------------------------


def plot(records: Records, out: Path) -> None:
    """``out``: memory against bytes per step; ``<out>-scaling``: overhead
    against W; ``<out>-fig63``: overhead and memory per fraction at W = 64."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = scenarios(records[0]["config"]["options"])[0]
    keys = list(dict.fromkeys(r["config"]["model"] for r in records))
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot_memory_vs_bytes(plt, records, keys, out)
    _plot_scaling(plt, records, keys, links.label, out.with_name(f"{out.stem}-scaling{out.suffix}"))
    _plot_fig63(plt, records, links.label, out.with_name(f"{out.stem}-fig63{out.suffix}"))


def _plot_memory_vs_bytes(plt: Any, records: Records, keys: list[str], out: Path) -> None:
    """Per model: K-FAC memory against the bytes a step moves, a line per W."""
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = _flat(_arms(records, key))
        for world in sorted({r["world_size"] for r in rows}):
            line = sorted(
                (r for r in rows if r["world_size"] == world),
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
                    fraction_label(r["grad_worker_fraction"]),
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
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _plot_scaling(plt: Any, records: Records, keys: list[str], links: str, out: Path) -> None:
    """Per model: the predicted overhead against W, a line per fraction."""
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = _flat(_arms(records, key))
        for label, pick in (
            ("MEM-OPT 1/W", lambda r: r["grad_workers"] == 1),
            ("1/8", lambda r: r["grad_worker_fraction"] == 1 / 8 and r["grad_workers"] > 1),
            ("1/4", lambda r: r["grad_worker_fraction"] == 1 / 4 and r["grad_workers"] > 1),
            ("HYBRID-OPT 1/2", lambda r: r["grad_worker_fraction"] == 0.5),
            ("COMM-OPT 1", lambda r: r["grad_worker_fraction"] == 1.0),
        ):
            line = sorted((r for r in rows if pick(r)), key=lambda r: r["world_size"])
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
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _plot_fig63(plt: Any, records: Records, links: str, out: Path) -> None:
    """Per model: overhead (bars) and memory (line) at every fraction, W = 64."""
    sweeps = {
        r["config"]["model"]: r["result"]["fractions"]
        for r in records
        if r["config"].get("sweep") == EVERY_FRACTION
    }
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4), squeeze=False)
    for ax, (key, rows) in zip(axes[0], sweeps.items()):
        labels = [fraction_label(r["grad_worker_fraction"]) for r in rows]
        ax.bar(range(len(rows)), [r["overhead_ms"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), labels)
        ax.set_xlabel(f"grad_worker_fraction at W={FIG63_WORLD}")
        ax.set_ylabel("predicted K-FAC overhead (ms/step)", color="tab:blue")
        mem = ax.twinx()
        mem.plot(range(len(rows)), [r["memory_mib"] / 1024 for r in rows], "o-", color="tab:red")
        mem.set_ylabel("K-FAC memory per rank (GiB)", color="tab:red")
        ax.set_title(
            f"{MODELS[key].name}: overhead and memory per fraction (predicted)\n{links}",
            fontsize=10,
        )
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


TABLES: dict[str, Callable[[Records], str]] = {
    f"{model}-{name}": partial(render, model=model)
    for model in MODELS
    for name, render in (
        ("memory", memory_table),
        ("overhead", overhead_table),
        ("stages", stages_table),
    )
}
TABLES["costs"] = costs_table

CASE = register(
    TimingCase(
        name="plan-paper",
        description="kaisa's planner on the SC'21 paper's ResNet-50 and BERT-Large at 8-1024 "
        "GPUs: memory, bytes, predicted overhead per fraction and link scenario",
        measure=measure,
        options={
            "models": list(MODELS),
            "worlds": list(WORLDS),
            # ranks per node of each scenario (0: one level, every collective at link_gbit)
            "gpus_per_node": [4, 8, 0],
            # Gb/s per rank between nodes (25: a 100 Gb/s NIC shared by 4 GPUs)
            "link_gbit": [25.0, 100.0, 200.0],
            "intra_gbit": 1200.0,  # per rank inside a node (NVLink class)
            "intra_latency_us": 3.0,
            "tflops": 14.0,  # the product rate (float32 without TF32)
        },
        quick={
            "models": ["resnet50"],
            "worlds": [8, 64],
            "gpus_per_node": [4],
            "link_gbit": [25.0],
        },
        tables=TABLES,
        plot=plot,
        deterministic=("layers", "auto", "auto_within_budget", "fractions"),
    )
)
