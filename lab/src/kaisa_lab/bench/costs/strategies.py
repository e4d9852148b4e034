"""Memory against communication across gradient-worker fractions (the SC'21 trade-off).

For every world size of ``world_sizes`` the case runs that many gloo ranks on
this machine (:func:`kaisa_lab.bench.costs.ranks.run_ranks`), and for every
fraction allowed there (1 = COMM-OPT, 1/W = MEM-OPT, HYBRID-OPT between) it
trains ``steps`` steps of a ResNet-style CNN (4 convolutions, 2 linear
layers; at ``width`` 32 the largest factor is 577 × 577) on random data,
``batch`` images of 16 × 16 per rank, gradients averaged over the ranks,
factors every step, inverses every ``inv_update_steps`` steps, kaisa's
default (inverse) method.  It records per fraction:

- K-FAC memory, ``memory_usage()`` of the largest rank per kind (``total``:
  the second-order tensors, the factors, and the products' reused CPU
  buffers, ``workspace``, held only where every rank preconditions every
  layer, f = 1);
- the bytes of every collective kind rank 0 sends or contributes
  (``comm_stats()``) on an inverse-update step and on an ordinary step,
  averaged over those steps (the same at every step count that has both);
- ``factor_bytes_if_allreduced``: the factor memory every rank would hold if
  factors were all-reduced (kfac-pytorch) instead of reduced to their owner;
- the median time of ``precond.step()`` (the first step left out; the largest
  over the ranks).

and per world size the median time of one ``reduce`` and one ``all_reduce``
of the whole factor payload (``repeats`` of each).  COMM-OPT sends nothing
but the factor reduction on ordinary steps and broadcasts the second-order
tensors on inverse steps; MEM-OPT never broadcasts them (one worker per
layer) but broadcasts preconditioned gradients every step.

Memory and bytes are exact (the tests compare a quick run with the committed
records); the times are not, and no table the docs render shows them.
Tables: ``memory`` (memory and bytes per fraction at the largest world size
measured, in bytes: what docs/reports/communication.md shows) and ``timing`` (every
world size, MB and the step's time, and reduce against all-reduce).  The
plot draws per-rank K-FAC memory against the bytes a rank sends per step
(averaged over an inverse interval), one line per world size and a point per
fraction, as the SC'21 paper's Fig. 6.3.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.distributed.plan import allowed_fractions
from kaisa_lab.bench.costs.ranks import run_ranks
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = ["CASE", "model_for_bench"]

#: the keys of ``memory_usage()`` the ``memory`` table shows, in its column order
MEMORY_KINDS = ("total", "second_order", "factors", "workspace")


def model_for_bench(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def _mean_bytes(steps: list[dict[str, Any]]) -> dict[str, float]:
    kinds = {k for s in steps for k in s}
    return {k: statistics.mean(s.get(k, {}).get("bytes", 0) for s in steps) for k in kinds}


def _fraction(fraction: float, options: Mapping[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank's figures at one fraction."""
    model = model_for_bench(options["width"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    interval = options["inv_update_steps"]
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        grad_worker_fraction=fraction,
        factor_update_steps=1,
        inv_update_steps=interval,
    )
    g = torch.Generator().manual_seed(rank)
    times: list[float] = []
    inverse_steps: list[dict[str, Any]] = []
    plain_steps: list[dict[str, Any]] = []
    for step in range(options["steps"]):
        x = torch.randn(options["batch"], 3, 16, 16, generator=g)
        y = torch.randint(0, 10, (options["batch"],), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.barrier()
        start = time.perf_counter()
        precond.step()
        elapsed = time.perf_counter() - start
        opt.step()
        if step > 0:  # the first step pays one-time costs
            times.append(elapsed)
        comm = precond.comm_stats()["step"]
        (inverse_steps if step % interval == 0 else plain_steps).append(comm)
    return {
        "grad_workers": precond.plan.grad_workers,
        "memory": precond.memory_usage(),
        "step_time_s": statistics.median(times),
        "bytes_inverse_step": _mean_bytes(inverse_steps),
        "bytes_plain_step": _mean_bytes(plain_steps),
        "factor_bytes_if_allreduced": sum(
            4 * (la.adapter.a_dim**2 + la.adapter.g_dim**2) for la in precond.layers.values()
        ),
    }


def _reduce_vs_allreduce(numel: int, repeats: int) -> dict[str, float]:
    """Median seconds of one reduce and one all-reduce of ``numel`` float32."""
    buf = torch.ones(numel)
    out: dict[str, float] = {}
    for name, op in (
        ("reduce_s", lambda: dist.reduce(buf, dst=0)),
        ("all_reduce_s", lambda: dist.all_reduce(buf)),
    ):
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op()
            samples.append(time.perf_counter() - start)
        out[name] = statistics.median(samples)
    return out


def _rank(rank: int, world: int, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every fraction allowed at ``world``, largest first, then the collectives."""
    fractions = {
        f: _fraction(f, options, rank, world)
        for f in sorted(allowed_fractions(world), reverse=True)
    }
    numel = next(iter(fractions.values()))["factor_bytes_if_allreduced"] // 4
    return {
        "fractions": fractions,
        "factor_numel": numel,
        "collectives": _reduce_vs_allreduce(numel, options["repeats"]),
    }


def fraction_label(fraction: float, world: int) -> str:
    """``1 (COMM-OPT)``, ``1/2 (HYBRID-OPT)``, ``1/4 (MEM-OPT)``, ..."""
    if fraction == 1:
        return "1 (COMM-OPT)"
    name = "MEM-OPT" if round(fraction * world) == 1 else "HYBRID-OPT"
    return f"1/{round(1 / fraction)} ({name})"


def measure(options: Mapping[str, Any]) -> list[Row]:
    if options["steps"] < 2 or options["steps"] <= options["inv_update_steps"]:
        raise ValueError(
            f"steps must exceed inv_update_steps ({options['inv_update_steps']}) and 1, "
            f"so that ordinary and inverse steps are both measured; got {options['steps']}"
        )
    rows = []
    for world in options["world_sizes"]:
        ranks = run_ranks(int(world), _rank, dict(options))
        for f, rank0 in ranks[0]["fractions"].items():
            mine = [r["fractions"][f] for r in ranks]
            result = {
                "grad_workers": rank0["grad_workers"],
                "memory": {k: max(m["memory"][k] for m in mine) for k in rank0["memory"]},
                "memory_total_per_rank": [m["memory"]["total"] for m in mine],
                "factor_bytes_if_allreduced": rank0["factor_bytes_if_allreduced"],
                "bytes_plain_step": rank0["bytes_plain_step"],
                "bytes_inverse_step": rank0["bytes_inverse_step"],
                "step_time_s": max(m["step_time_s"] for m in mine),
            }
            label = fraction_label(f, world).split()[0]
            rows.append(
                Row(
                    f"W={world} f={label}", {"world_size": world, "grad_worker_fraction": f}, result
                )
            )
        collectives = {
            "factor_numel": ranks[0]["factor_numel"],
            **{k: max(r["collectives"][k] for r in ranks) for k in ranks[0]["collectives"]},
        }
        rows.append(
            Row(
                f"W={world} reduce vs all_reduce",
                {"world_size": world, "collectives": "reduce vs all_reduce"},
                collectives,
            )
        )
    return rows


def _fractions(records: Records, world: int | None = None) -> list[Mapping[str, Any]]:
    """The per-fraction records (of ``world``, if given), by W then fraction, largest first."""
    mine = [
        r
        for r in records
        if "grad_worker_fraction" in r["config"]
        and (world is None or r["config"]["world_size"] == world)
    ]
    return sorted(
        mine, key=lambda r: (r["config"]["world_size"], -r["config"]["grad_worker_fraction"])
    )


def memory_table(records: Records) -> str:
    """Memory and bytes per fraction at the largest W measured, in bytes: each
    memory column its largest rank, traffic what rank 0 sends or contributes."""
    worlds = [r["config"]["world_size"] for r in _fractions(records)]
    if not worlds:
        return "(no fractions in this measurement)\n"
    world = max(worlds)
    lines = [
        "| grad_worker_fraction | workers/layer | K-FAC bytes / rank | 2nd-order | factors "
        "| workspace | factors if all-reduced | bytes / ordinary step | bytes / inverse step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _fractions(records, world):
        s = r["result"]
        memory = [s["memory"][k] for k in MEMORY_KINDS]
        sent = [sum(s["bytes_plain_step"].values()), sum(s["bytes_inverse_step"].values())]
        cells = [fraction_label(r["config"]["grad_worker_fraction"], world), str(s["grad_workers"])]
        cells += [f"{b:,.0f}" for b in (*memory, s["factor_bytes_if_allreduced"], *sent)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def timing_table(records: Records) -> str:
    """Every W and fraction in MB, with the median ``precond.step()`` time, then
    one reduce against one all-reduce of the factor payload per W."""
    mb = 2**20
    lines = [
        "| W | grad_worker_fraction | workers/layer | K-FAC MB / rank | MB / ordinary step "
        "| MB / inverse step | step() ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in _fractions(records):
        c, s = r["config"], r["result"]
        lines.append(
            f"| {c['world_size']} | {fraction_label(c['grad_worker_fraction'], c['world_size'])} "
            f"| {s['grad_workers']} | {s['memory']['total'] / mb:.3f} "
            f"| {sum(s['bytes_plain_step'].values()) / mb:.3f} "
            f"| {sum(s['bytes_inverse_step'].values()) / mb:.3f} | {1e3 * s['step_time_s']:.2f} |"
        )
    lines.append("")
    for r in sorted(
        (r for r in records if "collectives" in r["config"]),
        key=lambda r: r["config"]["world_size"],
    ):
        s = r["result"]
        lines.append(
            f"W = {r['config']['world_size']}: factor payload ({4 * s['factor_numel']:,} bytes): "
            f"reduce {1e3 * s['reduce_s']:.2f} ms, all_reduce {1e3 * s['all_reduce_s']:.2f} ms"
        )
    return "\n".join(lines) + "\n"


def plot(records: Records, out: Path) -> None:
    """Per-rank memory against bytes per step, one line per W, a point per fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for world in sorted({r["config"]["world_size"] for r in _fractions(records)}):
        rows = sorted(_fractions(records, world), key=lambda r: r["config"]["grad_worker_fraction"])
        # bytes per step averaged over an inverse-update interval
        steps = max(1, int(rows[0]["config"]["options"]["inv_update_steps"]))
        traffic = [
            (
                sum(r["result"]["bytes_inverse_step"].values())
                + (steps - 1) * sum(r["result"]["bytes_plain_step"].values())
            )
            / steps
            / 2**20
            for r in rows
        ]
        memory = [r["result"]["memory"]["total"] / 2**20 for r in rows]
        ax.plot(traffic, memory, "o-", label=f"W = {world}")
        for x, y, r in zip(traffic, memory, rows):
            ax.annotate(
                f"f={r['config']['grad_worker_fraction']:g}",
                (x, y),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
    ax.set_xlabel("MB sent per rank per step (averaged over an inverse interval)")
    ax.set_ylabel("K-FAC memory per rank (MB)")
    ax.set_title("KAISA: memory vs communication across grad_worker_fraction")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="strategies",
        description="memory vs communication per grad_worker_fraction on W gloo ranks "
        "(a small CNN), and reduce-to-owner vs all-reduce",
        measure=measure,
        options={
            "world_sizes": [1, 2, 4],
            "steps": 12,
            "inv_update_steps": 4,
            "batch": 32,
            "width": 32,
            "repeats": 5,  # of the reduce and the all-reduce
        },
        quick={"world_sizes": [2], "steps": 5, "repeats": 1},
        tables={"memory": memory_table, "timing": timing_table},
        plot=plot,
        deterministic=(
            "grad_workers",
            "memory",
            "memory_total_per_rank",
            "factor_bytes_if_allreduced",
            "bytes_plain_step",
            "bytes_inverse_step",
            "factor_numel",
        ),
    )
)
