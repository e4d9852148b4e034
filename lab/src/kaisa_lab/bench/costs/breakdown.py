"""Where a non-factor step's time goes, and the host's own part of a replayed one.

Each arm trains the same model from the same seed; K-FAC decomposes once,
at step 0, and never again (factor and inverse intervals beyond the run),
so every timed step is a non-factor step. The arms, run in turns
(:func:`~kaisa_lab.bench.timer.interleave`):

- ``first-order``: no kaisa;
- ``hooks only``: kaisa attached (its capture hooks on the modules, idle on
  non-factor steps) but ``step()`` not called after step 0: what the hooks
  cost the forward;
- ``kaisa``: ``step()`` every step, eagerly;
- ``kaisa, replayed``: a non-factor step's application recorded once and
  replayed (:mod:`kaisa.step.graphed`). On CUDA a CUDA graph
  (``precond.compile(mode="reduce-overhead")``); on a CPU, which has none,
  a recorder whose replay does nothing (``precond.compile(recorder=...)``),
  so ``step()``'s time is the host's own part of a replayed step — the
  checks, the schedule, the gradient marks — which is what a replayed step
  costs on a GPU beyond its one graph launch. Its scalars stay on the device
  (``precond.read_scalars = False``, as on an accelerator), and its
  gradients are reused (``zero_grad(set_to_none=False)``): a replay then
  copies nothing into the graph's tensors;
- ``kaisa, replayed, hooks off``: the same with kaisa's capture hooks off
  the modules after step 0 (``precond.hooks_off()``; a probe: a run with
  factor steps needs them).

Per arm, medians over every timed step of: the whole step (synchronised),
the host's time in forward+backward, in ``step()``, in the optimizer's
step, and the wait for the device after the host is done (the device's work
that launching did not hide). After the timing each kaisa arm takes three
more steps with a :class:`kaisa.step.profile.StepProfile` attached, whose
paths say whether the replayed arms replayed. On CUDA also the device's
kernel time per step (profiler) and the longest kernels of each arm that
calls ``step()``.

    kaisa bench run step-breakdown
    kaisa bench run step-breakdown --device cuda --option device=cuda
    kaisa bench report step-breakdown --table replay-host
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kaisa import KFACPreconditioner
from kaisa.step.profile import StepProfile
from kaisa_lab.bench.costs.launches import by_model, launch_models
from kaisa_lab.bench.costs.models import CompileModel, loss_of
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = ["ARMS", "PARTS", "BreakdownArm", "NoGraph"]

FIRST_ORDER, HOOKS_ONLY, KAISA = "first-order", "hooks only", "kaisa"
REPLAYED, HOOKS_OFF = "kaisa, replayed", "kaisa, replayed, hooks off"
ARMS = (FIRST_ORDER, HOOKS_ONLY, KAISA, REPLAYED, HOOKS_OFF)
PARTS = ("step", "forward+backward", "precond.step", "optimizer", "device wait")
NEVER = 10**9


class NoGraph:
    """A :class:`kaisa.step.graphed.Recorder` whose replay does nothing: the
    work runs once, at the recording; a replay leaves the host's part alone."""

    def record(self, work: Callable[[], None]) -> None:
        work()

    def replay(self) -> None:
        return None


class BreakdownArm:
    """One arm: a training step per call, its parts timed."""

    def __init__(self, name: str, model: CompileModel, device: str) -> None:
        self.name = name
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.model = model[0]().to(self.device)
        self.data = model[1]
        self.g = torch.Generator().manual_seed(1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.precond: KFACPreconditioner | None = None
        self.replayed = name in (REPLAYED, HOOKS_OFF)
        if name != FIRST_ORDER:
            self.precond = KFACPreconditioner(
                self.model,
                factor_update_steps=NEVER,
                inv_update_steps=NEVER,
                damping=0.01,
                kl_clip=0.001,
            )
        if self.precond is not None and self.replayed:
            if self.device.type == "cuda":
                self.precond.compile(mode="reduce-overhead")
            else:
                self.precond.read_scalars = False  # the verdict stays on the device
                self.precond.compile(recorder=NoGraph)
        self.calls_step = name in (KAISA, REPLAYED, HOOKS_OFF)
        self.parts: dict[str, list[float]] = {p: [] for p in PARTS}
        self.timed = False
        self.steps = 0
        self._hooks = contextlib.ExitStack()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self) -> None:
        x, y = (t.to(self.device) for t in self.data(self.g))
        self.sync()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=not self.replayed)
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
        if self.steps == 1 and self.name == HOOKS_OFF:
            assert self.precond is not None
            self._hooks.enter_context(self.precond.hooks_off())
        if self.timed:
            for part, seconds in zip(PARTS, (t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                self.parts[part].append(seconds)

    def paths(self, steps: int = 3) -> dict[str, int]:
        """The paths ``steps`` more steps took, as a profile saw them."""
        if self.precond is None or not self.calls_step:
            return {}
        self.precond.profile = found = StepProfile()
        for _ in range(steps):
            self()
        self.precond.profile = None
        return dict(Counter(path for path, _ in found.steps))

    def close(self) -> None:
        self._hooks.close()


def kernel_profile(arm: BreakdownArm, steps: int) -> dict[str, Any]:
    """Device kernel time per step and the longest kernels (CUDA only)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            arm()
    kernels: Counter[str] = Counter()
    total, count = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:60]] += e.device_time
            total += e.device_time
            count += 1
    return {
        "kernel_us_per_step": total / steps,
        "kernels_per_step": count / steps,
        "longest": [[name, round(us / steps, 1)] for name, us in kernels.most_common(8)],
    }


def measure(options: Mapping[str, Any]) -> list[Row]:
    device = str(options["device"])
    every = launch_models(options["batch"])
    unknown = [m for m in options["models"] if m not in every]
    if unknown:
        raise ValueError(f"step-breakdown: unknown models {unknown}; known: {list(every)}")
    rows = []
    for model in options["models"]:
        arms = {a: BreakdownArm(a, every[model], device) for a in ARMS}
        try:
            for _ in range(options["warmup"]):
                for arm in arms.values():
                    arm()
            for arm in arms.values():
                arm.timed = True
            interleave(dict(arms), rounds=options["rounds"], block=options["block"], warmup=0)
            for arm in arms.values():
                arm.timed = False
            precond = arms[KAISA].precond
            layers = 0 if precond is None else len(precond.layers)
            for name, arm in arms.items():
                ms = {p: 1e3 * statistics.median(v) for p, v in arm.parts.items()}
                result: dict[str, Any] = {
                    "median_ms": ms["step"],
                    "ms": ms,
                    "paths": arm.paths(),
                }
                if arm.device.type == "cuda" and name != HOOKS_ONLY:
                    result["kernels"] = kernel_profile(arm, 10)
                config = {
                    "model": model, "arm": name, "layers": layers, "batch": options["batch"],
                    "device": device, "replayed": arm.replayed,
                }  # fmt: skip
                rows.append(Row(f"{model} {name}", config, result))
        finally:
            for arm in arms.values():
                arm.close()
    return rows


# -- reports ---------------------------------------------------------------------------


def parts_table(records: Records) -> str:
    """Per model and arm: the medians of a non-factor step's parts (ms), and
    the whole step over the first-order one."""
    lines = [
        "| model | arm | " + " | ".join(f"{p} ms" for p in PARTS) + " | / first-order |",
        "|---|---|" + "---|" * (len(PARTS) + 1),
    ]
    for model, arms in by_model(records).items():
        base = arms[FIRST_ORDER]["result"]["ms"]["step"]
        for arm in (a for a in ARMS if a in arms):
            parts = arms[arm]["result"]["ms"]
            cells = " | ".join(f"{parts[p]:.3f}" for p in PARTS)
            lines.append(f"| {model} | {arm} | {cells} | {parts['step'] / base:.2f} |")
    return "\n".join(lines) + "\n"


def replay_host_table(records: Records) -> str:
    """Per model: ``step()`` eager and replayed (on a CPU the replay a no-op:
    the host's own part), and the replayed one per layer."""
    lines = [
        "| model | layers | eager step() µs | replayed step() µs | replayed µs per layer "
        "| replayed steps |",
        "|---|---|---|---|---|---|",
    ]
    for model, arms in by_model(records).items():
        eager = 1e3 * arms[KAISA]["result"]["ms"]["precond.step"]
        replay = arms[REPLAYED]
        replayed = 1e3 * replay["result"]["ms"]["precond.step"]
        layers = replay["config"]["layers"]
        paths = replay["result"]["paths"]
        seen = f"{paths.get('replayed', 0)} of {sum(paths.values())}"
        lines.append(
            f"| {model} | {layers} | {eager:.0f} | {replayed:.0f} | "
            f"{replayed / max(layers, 1):.1f} | {seen} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: Records, path: Path) -> None:
    """Each arm's host parts and device wait, stacked, a panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = by_model(records)
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.8), squeeze=False)
    for ax, (model, arms) in zip(axes[0], models.items(), strict=True):
        shown = [a for a in ARMS if a in arms]
        bottom = [0.0] * len(shown)
        for part in PARTS[1:]:
            heights = [arms[a]["result"]["ms"][part] for a in shown]
            ax.bar(range(len(shown)), heights, bottom=bottom, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_xticks(range(len(shown)), shown, rotation=20, fontsize=7)
        ax.set_title(model)
        ax.set_ylabel("ms per non-factor step (medians)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="step-breakdown",
        description="a non-factor step split into forward+backward, step(), optimizer and "
        "device wait, per arm (hooks idle, eager, replayed, hooks off)",
        measure=measure,
        options={
            "models": ["mlp", "cnn", "lm-2x128"],
            "batch": 32,
            "warmup": 5,
            "rounds": 5,
            "block": 20,
            "device": "cpu",
        },
        quick={"models": ["mlp"], "batch": 2, "warmup": 2, "rounds": 2, "block": 3},
        tables={"parts": parts_table, "replay-host": replay_host_table},
        plot=plot,
        device="any",
    )
)
