"""What kaisa's ``step()`` launches on a non-factor step, and what stacking saves (issue 24).

Per model — the field notes' MLP (784-512-512-10), the CNN and the two
Transformer LMs of ``compile_step.py`` (2 blocks of width 128; 12 identical
blocks of width 64) — and per arm (first-order only; kaisa with layers of one
shape stacked, :mod:`kaisa.step.batched`; kaisa one layer at a time; kaisa
stacked with ``precond.compile()``, the groups' kernel through inductor):

* **operators** run by one non-factor ``precond.step()`` (profiler op
  counts: on an accelerator each is about one kernel launch), its matrix
  products, and its **host reads** (``aten::_local_scalar_dense``: a value
  brought to the host), under CPU's rule (kaisa reads ν and the finiteness
  verdict as numbers on purpose, where that costs nothing) and under an
  accelerator's (``read_scalars = False``: they stay on the device);
* **step time** of the whole training step (forward, backward, ``step()``,
  SGD), arms run in turns (``--rounds`` × ``--block`` steps), the median
  over rounds of each round's mean.

K-FAC at factor/inverse intervals 10/100.  ``--device cuda`` runs the same on
a GPU (the step times synchronised; the compiled arm with CUDA graphs: a
non-factor step's application replayed, :mod:`kaisa.step.graphed`): the
issue's GPU goal is the second table's "/ first-order" columns (a non-factor
step, each timed on its own, the median), ≤ 1.15 on the MLP, the CNN and the
LMs; the first table's ratio is the mean step at 10/100.  Prints tables,
writes ``step_launches.json`` and ``step_launches.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_step import Case, cases, loss_of
from kaisa import KFACPreconditioner
from kaisa.step.batched import ShapeGroups

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


COMPILED = "kaisa stacked, compiled"
ARMS = ("first-order", "kaisa stacked", "kaisa per layer", COMPILED)


def mlp_case(batch: int) -> Case:
    def data(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def build() -> nn.Module:
        return nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    return build, data


class _Unstacked(ShapeGroups):
    """Every layer on its own (the path before stacking)."""

    def split(self, layers: Any) -> list[Any]:
        return []


class Arm:
    def __init__(self, name: str, case: Case, args: argparse.Namespace) -> None:
        self.name = name
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        self.model = case[0]().to(self.device)
        self.data = case[1]
        self.g = torch.Generator().manual_seed(1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.precond = None
        if name != "first-order":
            self.precond = KFACPreconditioner(
                self.model,
                factor_update_steps=args.factor_steps,
                inv_update_steps=args.inv_steps,
                damping=0.01,
                kl_clip=0.001,
            )
            if name == "kaisa per layer":
                application = self.precond._parts.pipeline.application
                application.groups = _Unstacked(application.method)
            if name == COMPILED:  # the groups' kernel through inductor (CUDA graphs on a GPU)
                mode = "reduce-overhead" if args.device.startswith("cuda") else None
                self.precond.compile(mode=mode)
        self.times: list[float] = []
        self.plain_times: list[float] = []
        #: the host's time in ``precond.step()`` of each non-factor step (no synchronisation)
        self.host_times: list[float] = []
        self.host_seconds = 0.0

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
                self.host_seconds = time.perf_counter() - start
        self.opt.step()
        return ops

    def upcoming_is_factor_step(self) -> bool:
        if self.precond is None:
            return False
        pipeline = self.precond._parts.pipeline
        return bool(pipeline.schedule.is_factor_step(pipeline.steps))

    def block(self, steps: int) -> None:
        """``steps`` steps, each timed on its own (synchronised on a GPU): the
        block's mean goes to ``times``, each non-factor step's time to
        ``plain_times`` (the issue's goal is about those)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        total = 0.0
        for _ in range(steps):
            factor = self.upcoming_is_factor_step()
            start = time.perf_counter()
            self.step()
            sync()
            seconds = time.perf_counter() - start
            total += seconds
            if not factor:
                self.plain_times.append(seconds)
                self.host_times.append(self.host_seconds)
        self.times.append(total / steps)


def median(values: list[float]) -> float:
    """NaN where no step was timed (a short run of factor steps only)."""
    return statistics.median(values) if values else math.nan


def run_case(name: str, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    arms = [Arm(a, case, args) for a in ARMS if not (args.no_compiled and a == COMPILED)]
    counts: dict[str, dict[str, int]] = {}
    for arm in arms:
        for _ in range(args.factor_steps + 1):  # past the first factor step
            arm.step()
        ops = arm.step(profiled=True)  # a non-factor step
        counts[arm.name] = {
            "operators": sum(n for name, n in ops.items() if name != "launches"),
            "products": sum(ops[p] for p in PRODUCTS),
            "host_reads": ops["aten::_local_scalar_dense"],
        }
        if arm.precond is not None:  # the next non-factor step under an accelerator's rule
            pipeline = arm.precond._parts.pipeline
            while pipeline.schedule.is_factor_step(pipeline.steps):
                arm.step()
            application = pipeline.application
            application.read_scalars = False
            kept = arm.step(profiled=True)
            counts[arm.name]["host_reads_kept_on_device"] = kept["aten::_local_scalar_dense"]
            counts[arm.name]["launches_kept_on_device"] = kept["launches"]
            # and a factor step that decomposes nothing (statistics folded)
            schedule = pipeline.schedule
            while not schedule.is_factor_step(pipeline.steps) or schedule.is_inverse_step(
                pipeline.steps
            ):
                arm.step()
            folded = arm.step(profiled=True)
            counts[arm.name]["factor_step_launches"] = folded["launches"]
            counts[arm.name]["factor_step_host_reads"] = folded["aten::_local_scalar_dense"]
            application.read_scalars = None
    for _ in range(args.rounds):
        for arm in arms:
            arm.block(args.block)
    ms = {arm.name: 1e3 * statistics.median(arm.times) for arm in arms}
    plain_ms = {arm.name: 1e3 * median(arm.plain_times) for arm in arms}
    host_ms = {arm.name: 1e3 * median(arm.host_times) for arm in arms}
    layers = 0 if arms[1].precond is None else len(arms[1].precond.layers)
    return {
        "model": name,
        "layers": layers,
        "step_ops": counts,
        "ms_per_step": ms,
        "ms_per_non_factor_step": plain_ms,
        "step_host_ms_non_factor": host_ms,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | layers | step() operators: stacked / per layer | products "
        "| kernel launches, accelerator rule: stacked / per layer "
        "| host reads (CPU rule / accelerator rule) "
        "| operators / launches compiled "
        "| first-order ms | kaisa stacked ms | kaisa per layer ms | compiled ms "
        "| stacked / first-order |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, p, ms = (
            r["step_ops"]["kaisa stacked"],
            r["step_ops"]["kaisa per layer"],
            r["ms_per_step"],
        )
        c = r["step_ops"].get(COMPILED)
        compiled = "–" if c is None else f"{c['operators']} / {c['launches_kept_on_device']}"
        compiled_ms = f"{ms[COMPILED]:.1f}" if COMPILED in ms else "–"
        lines.append(
            f"| {r['model']} | {r['layers']} | {s['operators']} / {p['operators']} | "
            f"{s['products']} / {p['products']} | "
            f"{s['launches_kept_on_device']} / {p['launches_kept_on_device']} | "
            f"{s['host_reads']} / {s['host_reads_kept_on_device']} | "
            f"{compiled} | "
            f"{ms['first-order']:.1f} | {ms['kaisa stacked']:.1f} | {ms['kaisa per layer']:.1f} | "
            f"{compiled_ms} | "
            f"{ms['kaisa stacked'] / ms['first-order']:.2f} |"
        )
    return "\n".join(lines)


def factor_table(results: list[dict[str, Any]]) -> str:
    """A factor step's ``step()`` that decomposes nothing (the statistics
    reduced and folded; accelerator rule): kernel launches and host reads."""
    arms = [a for a in ARMS[1:] if a in results[0]["step_ops"]]
    lines = [
        "| model | factor step() launches: "
        + " / ".join(arms)
        + " | host reads: "
        + " / ".join(arms)
        + " |",
        "|---|---|---|",
    ]
    for r in results:
        ops = r["step_ops"]
        launches = " / ".join(str(ops[a].get("factor_step_launches", "–")) for a in arms)
        reads = " / ".join(str(ops[a].get("factor_step_host_reads", "–")) for a in arms)
        lines.append(f"| {r['model']} | {launches} | {reads} |")
    return "\n".join(lines)


def non_factor_table(results: list[dict[str, Any]]) -> str:
    """The issue's GPU goal: a non-factor step (each timed on its own, the
    median) over the first-order step, <= 1.15; and the host's time in
    ``precond.step()`` alone (what is left when the device work is replayed)."""
    arms = [a for a in ARMS if a in results[0]["ms_per_non_factor_step"]]
    head = " | ".join(f"{a} ms" for a in arms)
    ratios = " | ".join(f"{a} / first-order" for a in arms[1:])
    hosts = " | ".join(f"step() host ms, {a}" for a in arms[1:])
    lines = [
        f"| model | non-factor step: {head} | {ratios} | {hosts} |",
        "|---|" + "---|" * (3 * len(arms) - 2),
    ]
    for r in results:
        ms, host = r["ms_per_non_factor_step"], r["step_host_ms_non_factor"]
        times = " | ".join(f"{ms[a]:.2f}" for a in arms)
        over = " | ".join(f"{ms[a] / ms['first-order']:.2f}" for a in arms[1:])
        hosted = " | ".join(f"{host[a]:.3f}" for a in arms[1:])
        lines.append(f"| {r['model']} | {times} | {over} | {hosted} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(results))
    for i, arm in enumerate(("kaisa stacked", "kaisa per layer")):
        shift = [x + (i - 0.5) * 0.35 for x in xs]
        left.bar(shift, [r["step_ops"][arm]["operators"] for r in results], 0.35, label=arm)
    for i, arm in enumerate(a for a in ARMS if a in results[0]["ms_per_step"]):
        shift = [x + (i - 1.5) * 0.2 for x in xs]
        right.bar(shift, [r["ms_per_step"][arm] for r in results], 0.2, label=arm)
    for ax, label in ((left, "operators in one non-factor step()"), (right, "ms per step")):
        ax.set_xticks(list(xs), [r["model"] for r in results], rotation=15)
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "lm-2x128", "lm-12x64"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--factor-steps", type=int, default=10)
    parser.add_argument("--inv-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--no-compiled", action="store_true", help="leave out the compiled arm (no inductor build)"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu or cuda (on CUDA the compiled arm uses CUDA graphs)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/step_launches"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    all_cases = {"mlp": mlp_case(args.batch), **cases(args.batch)}
    unknown = sorted(set(args.models) - set(all_cases))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed: {sorted(all_cases)}")
    results = []
    for name in args.models:
        results.append(run_case(name, all_cases[name], args))
        print(
            table(results[-1:]),
            non_factor_table(results[-1:]),
            factor_table(results[-1:]),
            sep="\n",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    (args.out / "step_launches.json").write_text(json.dumps(payload, indent=1))
    print(table(results), non_factor_table(results), factor_table(results), sep="\n\n")
    plot(results, args.out / "step_launches.png")


if __name__ == "__main__":
    main()
