"""Where a replayed non-factor step's extra time goes (issue 24's GPU goal).

`step_launches.py` gives the ratio a non-factor step of kaisa (replayed as
one CUDA graph, ``precond.compile(mode='reduce-overhead')``) takes over the
first-order step; this splits the difference.  Each arm trains the same
model from the same seed; K-FAC decomposes once at step 0 and never again
(``factor_update_steps = inv_update_steps`` beyond the run), so every timed
step is a non-factor step.  Arms, run in turns:

* ``first-order`` — no kaisa;
* ``hooks only`` — kaisa attached (its capture hooks on the modules, idle on
  non-factor steps) but ``step()`` not called after step 0: what the hooks
  cost the forward;
* ``kaisa`` — ``step()`` every step (replayed where ``--replay``; on CUDA
  the default);
* ``kaisa, hooks off`` — the same with the capture hooks taken off the
  modules after step 0 (a probe: a run with factor steps needs them).

Per arm, medians over every timed step of: the whole step (synchronised),
the host's time in forward+backward, in ``step()``, in the optimizer's
step, and the wait for the device after the host is done (the device's
work that launching did not hide).  On CUDA also the device's kernel time
per step (profiler) and the longest kernels of a ``kaisa`` step.  Prints a
table; writes ``step_breakdown.json`` and ``step_breakdown.png`` (each
arm's host parts and device wait, stacked) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_step import Case, cases, loss_of
from step_launches import COMPILED, mlp_case
from step_launches import Arm as LaunchesArm

ARMS = ("first-order", "hooks only", "kaisa", "kaisa, hooks off")
PARTS = ("step", "forward+backward", "precond.step", "optimizer", "device wait")
NEVER = 10**9


class Arm:
    def __init__(self, name: str, case: Case, device: torch.device, replay: bool) -> None:
        self.name = name
        self.device = device
        # built as step_launches.py builds its arms (the same seeds, optimizer, K-FAC)
        kind = "first-order" if name == "first-order" else COMPILED if replay else "kaisa stacked"
        never = argparse.Namespace(device=str(device), factor_steps=NEVER, inv_steps=NEVER)
        built = LaunchesArm(kind, case, never)
        self.model, self.data, self.g = built.model, built.data, built.g
        self.opt, self.precond = built.opt, built.precond
        self.calls_step = name in ("kaisa", "kaisa, hooks off")
        self.parts: dict[str, list[float]] = {p: [] for p in PARTS}
        self.steps = 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, timed: bool = False) -> None:
        x, y = (t.to(self.device) for t in self.data(self.g))
        self.sync()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.model(x), y).backward()
        t1 = time.perf_counter()
        if self.precond is not None and (self.calls_step or self.steps == 0):
            self.precond.step()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        self.sync()
        t4 = time.perf_counter()
        self.steps += 1
        if self.steps == 1 and self.name == "kaisa, hooks off":
            assert self.precond is not None
            for handle in self.precond._parts.capture._handles:
                handle.remove()  # off the modules; the preconditioner still counts as attached
        if timed:
            for part, seconds in zip(PARTS, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                self.parts[part].append(seconds)


def kernel_profile(arm: Arm, steps: int) -> dict[str, Any]:
    """Device kernel time per step and the longest kernels (CUDA only)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            arm.step()
    kernels: Counter[str] = Counter()
    total = 0.0
    count = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.device_time
            kernels[e.name[:60]] += us
            total += us
            count += 1
    return {
        "kernel_us_per_step": total / steps,
        "kernels_per_step": count / steps,
        "longest": [(name, round(us / steps, 1)) for name, us in kernels.most_common(8)],
    }


def run_case(name: str, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    replay = device.type == "cuda" if args.replay is None else args.replay
    arms = [Arm(a, case, device, replay) for a in ARMS]
    for arm in arms:
        for _ in range(args.warmup):
            arm.step()
    for _ in range(args.rounds):
        for arm in arms:
            for _ in range(args.block):
                arm.step(timed=True)
    medians = {
        arm.name: {p: 1e3 * statistics.median(v) for p, v in arm.parts.items()} for arm in arms
    }
    result: dict[str, Any] = {"model": name, "replayed": replay, "ms": medians}
    if device.type == "cuda":
        result["kernels"] = {
            arm.name: kernel_profile(arm, 10) for arm in arms if arm.name != "hooks only"
        }
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | arm | " + " | ".join(f"{p} ms" for p in PARTS) + " | / first-order |",
        "|---|---|" + "---|" * (len(PARTS) + 1),
    ]
    for r in results:
        base = r["ms"]["first-order"]["step"]
        for arm, parts in r["ms"].items():
            cells = " | ".join(f"{parts[p]:.3f}" for p in PARTS)
            lines.append(f"| {r['model']} | {arm} | {cells} | {parts['step'] / base:.2f} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        bottom = [0.0] * len(ARMS)
        for part in PARTS[1:]:
            heights = [r["ms"][arm][part] for arm in ARMS]
            ax.bar(range(len(ARMS)), heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(ARMS)), ARMS, rotation=20, fontsize=7)
        ax.set_title(r["model"])
        ax.set_ylabel("ms per non-factor step (medians)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "lm-2x128"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    replay = parser.add_mutually_exclusive_group()
    replay.add_argument("--replay", dest="replay", action="store_true", default=None)
    replay.add_argument("--no-replay", dest="replay", action="store_false")
    parser.add_argument("--out", type=Path, default=Path("runs/step_breakdown"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    every = {"mlp": mlp_case(args.batch), **cases(args.batch)}
    results = [run_case(m, every[m], args) for m in args.models]
    print(table(results))
    for r in results:
        for arm, k in r.get("kernels", {}).items():
            print(
                f"{r['model']} / {arm}: {k['kernels_per_step']:.0f} kernels, "
                f"{k['kernel_us_per_step']:.0f} µs of device time per step; longest {k['longest']}"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "device": args.device}
    if args.device.startswith("cuda"):
        meta["device_name"] = torch.cuda.get_device_name()
    path = args.out / "step_breakdown.json"
    path.write_text(
        json.dumps({"meta": meta, "args": vars(args), "results": results}, indent=1, default=str)
    )
    plot(results, args.out / "step_breakdown.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
