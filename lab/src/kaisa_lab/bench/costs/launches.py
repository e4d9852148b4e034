"""What kaisa's ``step()`` launches on a non-factor step, and what stacking saves.

On an accelerator a non-factor step is bound by kernel launches and host
reads, not by arithmetic; both can be counted on a CPU. Per model — the
784-512-512-10 MLP, the CNN and the two Transformer LMs of
:mod:`kaisa_lab.bench.costs.models` (2 blocks of width 128; 12 identical
blocks of width 64) — and per arm:

- ``first-order``: no K-FAC;
- ``kaisa stacked``: layers of one shape preconditioned stacked, one
  product per group (:mod:`kaisa.step.batched`, the default);
- ``kaisa per layer``: ``precond.stacking = False``, every layer on its own;
- ``kaisa stacked, compiled``: ``precond.compile()``, the groups' kernel
  through inductor (on CUDA ``mode="reduce-overhead"``: a non-factor step's
  application replayed as a CUDA graph, :mod:`kaisa.step.graphed`).

Counted on one profiled ``precond.step()`` (``torch.profiler`` operator
counts; on an accelerator each kernel-running operator is about one
launch):

- **operators** of a non-factor step, its **matrix products**, and its
  **host reads** (``aten::_local_scalar_dense``: a value brought to the
  host) under CPU's rule (kaisa reads ν and the finiteness verdict as
  numbers where that is free);
- **kernel launches** and host reads of the next non-factor step under an
  accelerator's rule (``precond.read_scalars = False``: they stay on the
  device);
- launches and host reads of a factor step that decomposes nothing (the
  statistics reduced and folded), under the accelerator's rule.

Then every arm's whole training step (forward, backward, ``step()``, SGD)
is timed in turns (:func:`~kaisa_lab.bench.timer.interleave`, ``block``
steps of each arm, ``rounds`` times; synchronised on a GPU): the median
over blocks of each block's mean (``median_ms``, at factor/inverse
intervals 10/100 a block of 10 holds one factor step), the median of the
non-factor steps alone, and the median host time spent in ``step()`` on
non-factor steps (what is left where the device's work is replayed).

    kaisa bench run step-launches
    kaisa bench run step-launches --device cuda --option device=cuda
    kaisa bench report step-launches --table non-factor
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from kaisa import KFACPreconditioner
from kaisa_lab.bench.costs.models import CompileModel, compile_models, loss_of, mlp
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = ["ARMS", "LaunchArm", "kernel_launches", "launch_models"]

PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul")
#: operators that make views or allocate (no kernel on an accelerator)
NO_KERNEL = frozenset(
    "aten::" + name
    for name in [
        *("as_strided", "reshape", "view", "unsqueeze", "squeeze", "select", "slice"),
        *("_reshape_alias", "expand", "transpose", "t", "detach", "alias", "resolve_conj"),
        *("resolve_neg", "to", "empty", "empty_strided", "permute", "diagonal", "unbind"),
        *("split", "chunk", "_unsafe_view", "view_as", "lift_fresh", "detach_"),
    ]
)
FIRST_ORDER, STACKED, PER_LAYER = "first-order", "kaisa stacked", "kaisa per layer"
COMPILED = "kaisa stacked, compiled"
ARMS = (FIRST_ORDER, STACKED, PER_LAYER, COMPILED)


def kernel_launches(events: Any) -> int:
    """Top-level operators that run a kernel: a foreach operator counts once
    (one multi-tensor launch on a GPU; its per-tensor children on CPU are not
    counted), views and allocations not at all."""
    return sum(
        1
        for e in events
        if e.name.startswith("aten::")
        and e.name not in NO_KERNEL
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


def launch_models(batch: int) -> dict[str, CompileModel]:
    """The MLP on flat 784-wide inputs, and the models of ``compile-step``."""

    def flat(g: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    return {"mlp": (mlp, flat), **compile_models(batch)}


class LaunchArm:
    """One model with SGD (and kaisa, as the arm says): a training step per call.

    Each call notes whether it was a factor step and, on a non-factor step,
    the host's time in ``precond.step()`` (not synchronised)."""

    def __init__(
        self, name: str, model: CompileModel, device: str, factor_steps: int, inv_steps: int
    ) -> None:
        self.name = name
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = model[0]().to(self.device)
        self.data = model[1]
        self.g = torch.Generator().manual_seed(1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.factor_steps = factor_steps
        self.inv_steps = inv_steps
        self.precond: KFACPreconditioner | None = None
        if name != FIRST_ORDER:
            self.precond = KFACPreconditioner(
                self.model,
                factor_update_steps=factor_steps,
                inv_update_steps=inv_steps,
                damping=0.01,
                kl_clip=0.001,
            )
            if name == PER_LAYER:
                self.precond.stacking = False
            if name == COMPILED:  # CUDA graphs on a GPU
                self.precond.compile(mode="reduce-overhead" if self.device.type == "cuda" else None)
        #: per call: was it a factor step, and the host's seconds in step()
        self.factor: list[bool] = []
        self.host_s: list[float] = []

    def factor_next(self) -> bool:
        """Whether the next ``step()`` is a factor step."""
        return self.precond is not None and self.precond.steps % self.factor_steps == 0

    def inverse_next(self) -> bool:
        return self.precond is not None and self.precond.steps % self.inv_steps == 0

    def step(self, profiled: bool = False) -> Counter[str]:
        x, y = (t.to(self.device) for t in self.data(self.g))
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.model(x), y).backward()
        ops: Counter[str] = Counter()
        if self.precond is not None:
            if profiled:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    self.precond.step()
                ops = Counter(e.name for e in prof.events())
                ops["launches"] = kernel_launches(prof.events())
            else:
                start = time.perf_counter()
                self.precond.step()
                self.host_s.append(time.perf_counter() - start)
        self.opt.step()
        return ops

    def __call__(self) -> None:
        self.factor.append(self.factor_next())
        if self.precond is None:
            self.host_s.append(0.0)
        self.step()

    def count(self) -> dict[str, int]:
        """The operator counts of a non-factor step (CPU's rule), then of the
        next non-factor step and of a factor step that decomposes nothing
        (both under the accelerator's rule)."""
        for _ in range(self.factor_steps + 1):  # past the first factor step
            self.step()
        while self.factor_next():
            self.step()
        ops = self.step(profiled=True)
        counts = {
            "operators": sum(n for name, n in ops.items() if name != "launches"),
            "products": sum(ops[p] for p in PRODUCTS),
            "host_reads": ops["aten::_local_scalar_dense"],
        }
        if self.precond is None:
            return counts
        self.precond.read_scalars = False
        while self.factor_next():
            self.step()
        kept = self.step(profiled=True)
        counts["host_reads_kept_on_device"] = kept["aten::_local_scalar_dense"]
        counts["launches_kept_on_device"] = kept["launches"]
        while not self.factor_next() or self.inverse_next():
            self.step()
        folded = self.step(profiled=True)
        counts["factor_step_launches"] = folded["launches"]
        counts["factor_step_host_reads"] = folded["aten::_local_scalar_dense"]
        self.precond.read_scalars = None
        return counts


def _median(values: Sequence[float]) -> float:
    """NaN where nothing was timed (a short run of factor steps only)."""
    return statistics.median(values) if values else math.nan


def measure(options: Mapping[str, Any]) -> list[Row]:
    device = str(options["device"])
    every = launch_models(options["batch"])
    unknown = [m for m in options["models"] if m not in every]
    if unknown:
        raise ValueError(f"step-launches: unknown models {unknown}; known: {list(every)}")
    names = [a for a in ARMS if options["compiled"] or a != COMPILED]
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    f, inv, block = options["factor_steps"], options["inv_steps"], options["block"]
    rows = []
    for model in options["models"]:
        arms = {a: LaunchArm(a, every[model], device, f, inv) for a in names}
        counts = {a: arm.count() for a, arm in arms.items()}
        for arm in arms.values():
            arm.factor.clear()
            arm.host_s.clear()
        timed = interleave(dict(arms), rounds=options["rounds"], block=block, warmup=0, sync=sync)
        precond = arms[STACKED].precond
        layers = 0 if precond is None else len(precond.layers)
        for name, arm in arms.items():
            samples = timed[name].samples_ms
            blocks = [
                statistics.fmean(samples[i : i + block]) for i in range(0, len(samples), block)
            ]
            plain = [s for s, factor in zip(samples, arm.factor, strict=True) if not factor]
            host = [1e3 * h for h, factor in zip(arm.host_s, arm.factor, strict=True) if not factor]
            config = {
                "model": model, "arm": name, "layers": layers, "batch": options["batch"],
                "factor_steps": f, "inv_steps": inv, "device": device,
            }  # fmt: skip
            result = {
                **counts[name],
                "median_ms": statistics.median(blocks),
                "mean_ms": timed[name].mean_ms,
                "non_factor_ms": _median(plain),
                "step_host_ms_non_factor": _median(host),
            }
            rows.append(Row(f"{model} {name}", config, result))
    return rows


# -- reports ---------------------------------------------------------------------------


def by_model(records: Records) -> dict[str, dict[str, Mapping[str, Any]]]:
    """Each model's records by arm (models in the order measured)."""
    out: dict[str, dict[str, Mapping[str, Any]]] = {}
    for r in records:
        out.setdefault(r["config"]["model"], {})[r["config"]["arm"]] = r
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    """A figure, or a dash where there is none (an arm left out, nothing timed)."""
    if value is None or math.isnan(value):
        return "–"
    return f"{value:.{digits}f}"


def launches_table(records: Records) -> str:
    """Per model: what a non-factor ``step()`` runs, stacked against per layer,
    and each arm's mean step."""
    lines = [
        "| model | layers | step() operators: stacked / per layer | products "
        "| kernel launches, accelerator rule: stacked / per layer "
        "| host reads (CPU rule / accelerator rule) | operators / launches compiled "
        "| first-order ms | kaisa stacked ms | kaisa per layer ms | compiled ms "
        "| stacked / first-order |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, arms in by_model(records).items():
        s, p = arms[STACKED]["result"], arms[PER_LAYER]["result"]
        c = arms[COMPILED]["result"] if COMPILED in arms else None
        ms = {a: r["result"]["median_ms"] for a, r in arms.items()}
        compiled = "–" if c is None else f"{c['operators']} / {c['launches_kept_on_device']}"
        lines.append(
            f"| {model} | {arms[STACKED]['config']['layers']} | "
            f"{s['operators']} / {p['operators']} | {s['products']} / {p['products']} | "
            f"{s['launches_kept_on_device']} / {p['launches_kept_on_device']} | "
            f"{s['host_reads']} / {s['host_reads_kept_on_device']} | {compiled} | "
            f"{ms[FIRST_ORDER]:.1f} | {ms[STACKED]:.1f} | {ms[PER_LAYER]:.1f} | "
            f"{_fmt(ms.get(COMPILED))} | {ms[STACKED] / ms[FIRST_ORDER]:.2f} |"
        )
    return "\n".join(lines) + "\n"


def non_factor_table(records: Records) -> str:
    """A non-factor step (each timed on its own, the median) over the
    first-order step, and the host's time in ``precond.step()`` alone."""
    models = by_model(records)
    arms = [a for a in ARMS if all(a in m for m in models.values())]
    head = " | ".join(f"{a} ms" for a in arms)
    ratios = " | ".join(f"{a} / first-order" for a in arms[1:])
    hosts = " | ".join(f"step() host ms, {a}" for a in arms[1:])
    lines = [
        f"| model | non-factor step: {head} | {ratios} | {hosts} |",
        "|---|" + "---|" * (3 * len(arms) - 2),
    ]
    for model, found in models.items():
        ms = {a: found[a]["result"]["non_factor_ms"] for a in arms}
        host = {a: found[a]["result"]["step_host_ms_non_factor"] for a in arms}
        times = " | ".join(_fmt(ms[a], 2) for a in arms)
        over = " | ".join(_fmt(ms[a] / ms[FIRST_ORDER], 2) for a in arms[1:])
        hosted = " | ".join(_fmt(host[a], 3) for a in arms[1:])
        lines.append(f"| {model} | {times} | {over} | {hosted} |")
    return "\n".join(lines) + "\n"


def factor_table(records: Records) -> str:
    """A factor step's ``step()`` that decomposes nothing (the statistics
    reduced and folded; accelerator rule): kernel launches and host reads."""
    models = by_model(records)
    arms = [a for a in ARMS[1:] if all(a in m for m in models.values())]
    lines = [
        f"| model | factor step() launches: {' / '.join(arms)} | host reads: {' / '.join(arms)} |",
        "|---|---|---|",
    ]
    for model, found in models.items():
        launches = " / ".join(str(found[a]["result"]["factor_step_launches"]) for a in arms)
        reads = " / ".join(str(found[a]["result"]["factor_step_host_reads"]) for a in arms)
        lines.append(f"| {model} | {launches} | {reads} |")
    return "\n".join(lines) + "\n"


def plot(records: Records, path: Path) -> None:
    """Operators of one non-factor ``step()`` (stacked, per layer) and each
    arm's ms per step, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = by_model(records)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = list(range(len(models)))
    for i, arm in enumerate((STACKED, PER_LAYER)):
        heights = [m[arm]["result"]["operators"] for m in models.values()]
        left.bar([x + (i - 0.5) * 0.35 for x in xs], heights, 0.35, label=arm)
    shown = [a for a in ARMS if all(a in m for m in models.values())]
    for i, arm in enumerate(shown):
        heights = [m[arm]["result"]["median_ms"] for m in models.values()]
        right.bar([x + (i - 1.5) * 0.2 for x in xs], heights, 0.2, label=arm)
    for ax, label in ((left, "operators in one non-factor step()"), (right, "ms per step")):
        ax.set_xticks(xs, list(models), rotation=15)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="step-launches",
        description="what a non-factor step() launches and reads back (stacked, per layer, "
        "compiled), and each arm's step time in turns",
        measure=measure,
        options={
            "models": ["mlp", "cnn", "lm-2x128", "lm-12x64"],
            "batch": 32,
            "rounds": 5,
            "block": 10,
            "factor_steps": 10,
            "inv_steps": 100,
            "compiled": True,
            "device": "cpu",
        },
        quick={
            "models": ["mlp"],
            "batch": 2,
            "rounds": 2,
            "block": 3,
            "factor_steps": 3,
            "inv_steps": 9,
            "compiled": False,
        },
        tables={"launches": launches_table, "non-factor": non_factor_table, "factor": factor_table},
        plot=plot,
        device="any",
    )
)
