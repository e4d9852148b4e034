"""The cost of every stage of a K-FAC step, next to the floor of each stage.

A step splits into forward+backward (measured on a twin model without
K-FAC, its steps interleaved with the K-FAC model's so the machine's load
falls on both alike) and the stages K-FAC adds, as the step times them
itself (:class:`kaisa.step.profile.StepProfile`, attached for the timed
window only):

* capture, per layer type: the A terms (the input rows built and reduced to
  their Gram; a convolution builds its patch rows in chunks inside the
  Gram; an Embedding counts its ids), the G terms (the output gradients'
  Gram), and the hooks and sums around them;
* reduce (the statistics onto their owners: on one process, handing them
  over) and the running average (the batch factors divided and folded);
* decomposition (eigh, or Cholesky and inverse, per dense factor);
* preconditioning products (the method's, per layer, in place, or per
  stacked group);
* KL clip + write-back (the rest of the application: reading the
  gradients, ``⟨V, ∇⟩``, the scale, writing back);
* step() bookkeeping (the rest of ``step()``: the checks, the schedule,
  the gradient marks).

The *floor* of a stage is the arithmetic it cannot avoid, timed on bare
kernels of the shapes the step worked on (``record_shapes``: each timed
piece's :class:`kaisa.step.profile.Operation`), as many times as the stage
ran them: an A term, one copy of its rows and their Gram
(:func:`kaisa.core.statistics.gram`, by blocks where kaisa uses them); a G
term, its Gram; a diagonal factor, a sum of squares; an Embedding's A, one
scatter of its ids; the running average, one ``lerp_`` per factor; the
decomposition, ``torch.linalg.eigh`` or ``cholesky`` + ``cholesky_inverse``
per dense factor; the products, ``Q_Gᵀ ∇ Q_A`` and back (eigen) or
``G⁻¹ ∇ A⁻¹`` (inverse), batched for a stacked group; the write-back, one
copy of the gradient. The running average and the write-back touch
operands that are out of cache when the step reaches them, so their floor
is also timed cold (after evicting the caches).

Every figure is per step, amortised over a window of steps that is a
multiple of the inverse interval, so each stage ran exactly ``window /
interval`` times in it. The measured K-FAC overhead is the K-FAC model's
step time less the twin's, over the same window; what the stages do not
account for is reported as "unattributed" (the test checks that the stages
add up to the overhead within a factor).

Batches are drawn in turn from a pool of 8 random ones, and flush-to-zero
is on (``torch.set_flush_denormal``): a model trained on one fixed batch
drifts into float32 subnormals that slow CPU matrix products 10–20×.

A record per stage of each model and setting (its ``median_ms``: the
stage's ms per step, what ``kaisa bench ab stages`` compares), and one per
setting with the totals (arm ``... · K-FAC overhead``).

    kaisa bench run stages
    kaisa bench run stages --quick
    kaisa bench ab stages --before HEAD~1 --quick --rounds 3
    kaisa bench report stages --table stages --plot stages.png
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner, tune_cpu_allocator
from kaisa.core.statistics import gram
from kaisa.step.profile import (
    APPLY,
    BOOKKEEPING,
    CAPTURE,
    DECOMPOSE,
    FOLD,
    HOOKS_AND_SUMS,
    KL_AND_WRITE,
    PRODUCTS,
    STEP,
    Operation,
    StepProfile,
)
from kaisa_lab.bench.costs.models import loss_of, mlp
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register
from kaisa_lab.tasks.digits import DigitsCNNTask
from kaisa_lab.tasks.transformer import CharTransformer

__all__ = ["MODELS", "SETTINGS", "floor_kernels", "kernel_fn", "window_steps"]

# -- models ------------------------------------------------------------------------


def tiny_mlp() -> nn.Module:
    """A model small enough for the quick run."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def cnn() -> nn.Module:
    """3 convolutions (3→32→64→64, each pooled) + 2 Linear layers on 3×32×32."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128),
        nn.ReLU(inplace=True),
        nn.Linear(128, 10),
    )


VOCAB, CONTEXT = 64, 32


def transformer() -> nn.Module:
    """One block of the text-lm task's Transformer (d=128, 4 heads), context 32."""
    return CharTransformer(vocab_size=VOCAB, context=CONTEXT, d_model=128, n_heads=4, n_layers=1)


Draw = Callable[[int, torch.Generator], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Model:
    """A model, how to draw a batch for it, and K-FAC options it needs."""

    build: Callable[[], nn.Module]
    batch: Draw
    kfac: Mapping[str, Any] = field(default_factory=dict)


def _images(shape: tuple[int, ...]) -> Draw:
    def draw(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(n, *shape, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return draw


def _tokens(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


MODELS: dict[str, Model] = {
    "mlp": Model(mlp, _images((1, 28, 28))),
    "cnn": Model(cnn, _images((3, 32, 32))),
    "digits-cnn": Model(lambda: DigitsCNNTask().build_model(), _images((1, 8, 8))),
    "transformer": Model(transformer, _tokens, {"loss_average": "batch_and_sequence"}),
    "tiny-mlp": Model(tiny_mlp, _images((1, 8, 8))),
}
#: (compute_method, factor_update_steps, inv_update_steps)
SETTINGS = (("eigen", 1, 10), ("eigen", 10, 100), ("inverse", 1, 10), ("inverse", 10, 100))

# -- the floors: bare kernels of the same shapes ----------------------------------

Kernel = tuple[Any, ...]
KL = KL_AND_WRITE
#: derived stages count the calls of the phase they are a remainder of
CALLS_FROM = {HOOKS_AND_SUMS: CAPTURE, KL_AND_WRITE: APPLY, BOOKKEEPING: STEP}
#: stages whose operands are out of cache when the step reaches them (a
#: running factor is touched once per factor step, the gradients once per
#: step): their floor is also timed cold, after evicting the caches
COLD_STAGES = (FOLD, KL)


def floor_kernels(op: Operation, method: str) -> list[tuple[str, Kernel]]:
    """The bare kernels one recorded operation cannot avoid, by the stage they charge."""
    if op.phase.startswith("capture: "):
        source = op.phase.removeprefix("capture: ")[0]
        if op.kind == "dense":
            rows = [(op.phase, ("copy", op.shape))] if source == "A" else []
            return [*rows, (op.phase, ("gram", op.shape))]
        if op.kind == "diagonal" and op.phase.endswith("(Embedding)") and source == "A":
            return [(op.phase, ("scatter", *op.shape))]  # ids counted, never one-hot rows
        if op.kind == "diagonal":
            return [(op.phase, ("sqsum", op.shape))]
        return []  # block-diagonal: no bare kernel stands for it
    if op.kind == "fold":
        return [(FOLD, ("lerp", op.shape))]
    if op.phase == DECOMPOSE:
        return [(DECOMPOSE, ("eigh" if op.kind == "eigh" else "cholinv", op.shape[0]))]
    if op.kind == "products":
        return [(PRODUCTS, ("products", method, op.shape, op.factors)), (KL, ("copy", op.shape))]
    return []


def _spd(d: int) -> Tensor:
    x = torch.randn(d, d)
    return x @ x.t() / d + 1e-3 * torch.eye(d)


def _products(method: str, shape: tuple[int, ...], dims: tuple[int, ...]) -> Callable[[], Any]:
    """``Q_Gᵀ ∇ Q_A`` and back (eigen) or ``G⁻¹ ∇ A⁻¹`` (inverse); a factor that
    is not dense (size 0) contributes no product. A stacked group ``[L, g, a]``
    takes batched products."""
    grad = torch.randn(*shape)
    lead = shape[:-2]
    g = torch.randn(*lead, dims[0], dims[0]) if dims[0] else None
    a = torch.randn(*lead, dims[1], dims[1]) if dims[1] else None

    def forward(v: Tensor, gm: Tensor | None, am: Tensor | None) -> Tensor:
        v = v if gm is None else gm @ v
        return v if am is None else v @ am

    if method == "inverse":
        return lambda: forward(grad, g, a)
    gt, at = (None if g is None else g.mT), (None if a is None else a.mT)
    return lambda: forward(forward(grad, gt, a), g, at)


def kernel_fn(kernel: Kernel) -> Callable[[], Any]:
    """A zero-argument callable running the bare kernel on fresh random tensors."""
    kind = kernel[0]
    if kind == "copy":
        src = torch.randn(*kernel[1])
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    if kind == "gram":  # kaisa's own bare Gram: by blocks on CPU from width 256
        x = torch.randn(*kernel[1])
        return lambda: gram(x)
    if kind == "sqsum":
        x = torch.randn(*kernel[1])
        return lambda: (x * x).sum(0)
    if kind == "scatter":  # an Embedding's counts: a scatter into a fixed-size vector
        idx = torch.randint(0, kernel[2], (kernel[1],))
        ones = torch.ones(kernel[1])
        return lambda: torch.zeros(kernel[2]).index_add_(0, idx, ones)
    if kind == "lerp":
        running, batch = torch.rand(*kernel[1]), torch.rand(*kernel[1])
        return lambda: running.lerp_(batch, 0.05)
    if kind == "eigh":
        m = _spd(kernel[1])
        return lambda: torch.linalg.eigh(m)
    if kind == "cholinv":
        m = _spd(kernel[1])
        return lambda: torch.cholesky_inverse(torch.linalg.cholesky(m))
    if kind == "products":
        return _products(kernel[1], kernel[2], kernel[3])
    raise ValueError(f"unknown kernel {kernel!r}")


@functools.cache
def _eviction_buffer() -> Tensor:
    """64 MiB, more than a CPU's last-level cache, allocated on first use."""
    return torch.empty(16 << 20)


def cold_kernel_seconds(kernel: Kernel, cache: dict[Kernel, float], runs: int = 9) -> float:
    """Median time of one run of ``kernel`` right after the caches were evicted
    (the eviction is not timed)."""
    key = ("cold", *kernel)
    if key not in cache:
        fn = kernel_fn(kernel)
        fn()
        times = []
        for _ in range(runs):
            _eviction_buffer().fill_(1.0)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        cache[key] = statistics.median(times)
    return cache[key]


def kernel_seconds(kernel: Kernel, cache: dict[Kernel, float], budget_s: float = 0.25) -> float:
    """Median time of one run of ``kernel`` (cached: shapes repeat across settings).

    Repeats until about ``budget_s`` is spent (5 to 50 runs) after one warm-up:
    on a shared machine a median of fewer runs can land on a burst of load."""
    if kernel not in cache:
        fn = kernel_fn(kernel)
        t0 = time.perf_counter()
        fn()
        first = time.perf_counter() - t0
        runs = []
        for _ in range(max(5, min(50, int(budget_s / max(first, 1e-7))))):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        cache[kernel] = statistics.median(runs)
    return cache[kernel]


# -- one model × setting -----------------------------------------------------------

POOL = 8  # distinct random batches, drawn in turn: no batch is ever fitted
WARMUP = 2  # steps before the window (the first decomposition, lazy allocations)


def window_steps(steps: int, inv: int) -> int:
    """``steps`` rounded up to a multiple of the inverse interval (so every
    stage ran exactly window / interval times in the window)."""
    return -(-max(steps, inv) // inv) * inv


class Arm:
    """A model with SGD (and K-FAC where ``kfac`` is given): one training step
    per call on the next batch of the pool; forward+backward timed apart."""

    def __init__(self, model: Model, kfac: Mapping[str, Any] | None, batch: int) -> None:
        torch.manual_seed(0)
        self.model = model.build()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.precond = (
            None
            if kfac is None
            else KFACPreconditioner(self.model, optimizer=self.opt, **model.kfac, **kfac)
        )
        gen = torch.Generator().manual_seed(1)
        self.pool = [model.batch(batch, gen) for _ in range(POOL)]
        self.index = 0
        self.fwd_bwd_s = 0.0

    def __call__(self) -> None:
        x, y = self.pool[self.index % POOL]
        self.index += 1
        t0 = time.perf_counter()
        self.opt.zero_grad()
        loss_of(self.model(x), y).backward()
        self.fwd_bwd_s += time.perf_counter() - t0
        if self.precond is not None:
            self.precond.step()
        self.opt.step()


def run_setting(
    model: Model, method: str, f: int, inv: int, steps: int, batch: int
) -> tuple[StepProfile, dict[str, float], int]:
    """Train a K-FAC model and its plain twin in turns; the K-FAC model's
    profile over the window, the twin's and the K-FAC model's ms per step."""
    kfac = {"compute_method": method, "factor_update_steps": f, "inv_update_steps": inv}
    plain, kfac_arm = Arm(model, None, batch), Arm(model, kfac, batch)
    for _ in range(WARMUP):
        plain()
        kfac_arm()
    assert kfac_arm.precond is not None
    profile = StepProfile(record_shapes=True)
    kfac_arm.precond.profile = profile
    plain.fwd_bwd_s = 0.0
    window = window_steps(steps, inv)
    timed = interleave({"plain": plain, "kfac": kfac_arm}, rounds=window, warmup=0)
    kfac_arm.precond.profile = None
    times = {
        "plain_step_ms": timed["plain"].mean_ms,
        "kfac_step_ms": timed["kfac"].mean_ms,
        "fwd_bwd_ms": 1e3 * plain.fwd_bwd_s / window,
    }
    return profile, times, window


def summarise(
    profile: StepProfile, times: Mapping[str, float], window: int, method: str,
    cache: dict[Kernel, float],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Per-step figures (ms): every stage with its floor, and the totals."""
    floors: dict[str, float] = defaultdict(float)
    cold: dict[str, float] = defaultdict(float)
    for op in profile.operations:
        for stage, kernel in floor_kernels(op, method):
            floors[stage] += kernel_seconds(kernel, cache)
            if stage in COLD_STAGES:
                cold[stage] += cold_kernel_seconds(kernel, cache)
    per_step = 1e3 / window
    stages: list[dict[str, Any]] = []
    for stage, seconds in profile.stages().items():
        ms, floor = seconds * per_step, floors.get(stage, 0.0) * per_step
        stages.append(
            {
                "stage": stage,
                "ms": ms,
                "floor_ms": floor,
                "ratio": ms / floor if floor > 0 else None,
                # the floor with the operands out of cache (= floor_ms where they fit)
                "cold_floor_ms": cold[stage] * per_step if stage in COLD_STAGES else floor,
                "calls": profile.calls.get(CALLS_FROM.get(stage, stage), 0),
            }
        )
    total = sum(st["ms"] for st in stages)
    floor_total = sum(st["floor_ms"] for st in stages)
    cold_total = sum(st["cold_floor_ms"] for st in stages)
    overhead = times["kfac_step_ms"] - times["plain_step_ms"]
    totals = {
        **times,
        "window_steps": window,
        "overhead_ms": overhead,
        "stage_sum_ms": total,
        "floor_sum_ms": floor_total,
        "overhead_over_floor": total / floor_total if floor_total > 0 else None,
        "cold_floor_sum_ms": cold_total,
        "overhead_over_cold_floor": total / cold_total if cold_total > 0 else None,
        "unattributed_ms": overhead - total,
    }
    return stages, totals


TOTAL = "K-FAC overhead"


def setting_label(method: str, f: int, inv: int) -> str:
    return f"{method} f={f} inv={inv}"


def measure(options: Mapping[str, Any]) -> list[Row]:
    unknown = [m for m in options["models"] if m not in MODELS]
    if unknown:
        raise ValueError(f"stages: unknown models {unknown}; known: {list(MODELS)}")
    tuned = options["allocator"] != "default" and tune_cpu_allocator()
    flush = torch.set_flush_denormal(True)
    try:
        return _measure(options, tuned, flush)
    finally:
        torch.set_flush_denormal(False)


def _measure(options: Mapping[str, Any], tuned: bool, flush: bool) -> list[Row]:
    cache: dict[Kernel, float] = {}
    rows = []
    for name in options["models"]:
        for method, f, inv in options["settings"]:
            profile, times, window = run_setting(
                MODELS[name], method, f, inv, options["steps"], options["batch"]
            )
            stages, totals = summarise(profile, times, window, method, cache)
            setting = setting_label(method, f, inv)
            config = {
                "model": name,
                "method": method,
                "factor_steps": f,
                "inv_steps": inv,
                "setting": setting,
                "batch": options["batch"],
                "allocator": "glibc, thresholds raised" if tuned else "default",
                "flush_denormal": flush,
            }
            for order, st in enumerate(stages):
                rows.append(
                    Row(
                        f"{name} {setting} · {st['stage']}",
                        {**config, "kind": "stage", "stage": st["stage"], "order": order},
                        {**st, "median_ms": st["ms"]},
                    )
                )
            rows.append(
                Row(
                    f"{name} {setting} · {TOTAL}",
                    {**config, "kind": "total"},
                    {**totals, "median_ms": totals["overhead_ms"]},
                )
            )
    return rows


# -- reports ---------------------------------------------------------------------------

Records = Sequence[Mapping[str, Any]]


def runs(records: Records) -> list[dict[str, Any]]:
    """One run per model and setting: its totals and its stages in step order."""
    by: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        c = r["config"]
        run = by.setdefault((c["model"], c["setting"]), {"model": c["model"], "config": c})
        if c["kind"] == "total":
            run["totals"] = r["result"]
        else:
            run.setdefault("stages", []).append((c["order"], r["result"]))
    out = []
    for run in by.values():
        run["stages"] = [st for _, st in sorted(run.get("stages", []), key=lambda x: x[0])]
        if "totals" in run:
            out.append(run)
    models = list(MODELS)
    settings = [setting_label(*s) for s in SETTINGS]

    def key(run: Mapping[str, Any]) -> tuple[int, int, str]:
        c = run["config"]
        m = models.index(c["model"]) if c["model"] in models else len(models)
        s = settings.index(c["setting"]) if c["setting"] in settings else len(settings)
        return m, s, c["setting"]

    return sorted(out, key=key)


def _ratio(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def stages_table(records: Records) -> str:
    """Per model and setting: every stage (ms per step) beside its floor, then the totals."""
    blocks = []
    for run in runs(records):
        t = run["totals"]
        lines = [
            f"**{run['model']} · {run['config']['setting']}** · per step over "
            f"{t['window_steps']} steps · forward+backward without K-FAC "
            f"{t['fwd_bwd_ms']:.2f} ms",
            "",
            "| stage | ms / step | floor (ms) | × floor | cold floor (ms) |",
            "|---|---|---|---|---|",
        ]
        for st in run["stages"]:
            lines.append(
                f"| {st['stage']} | {st['ms']:.3f} | {st['floor_ms']:.3f} | "
                f"{_ratio(st['ratio'])} | {st['cold_floor_ms']:.3f} |"
            )
        lines.append(
            f"| sum of stages | {t['stage_sum_ms']:.3f} | {t['floor_sum_ms']:.3f} | "
            f"{_ratio(t['overhead_over_floor'])} | {t['cold_floor_sum_ms']:.3f} |"
        )
        lines.append(
            f"| K-FAC overhead (measured) | {t['overhead_ms']:.3f} | | | "
            f"unattributed {t['unattributed_ms']:+.3f} |"
        )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def summary_table(records: Records) -> str:
    """Per model and setting: the measured overhead, the stages' sum, their floor."""
    lines = [
        "| model | setting | SGD step (ms) | K-FAC overhead (ms) | sum of stages (ms) "
        "| floor (ms) | × floor | × cold floor | unattributed (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs(records):
        t = run["totals"]
        lines.append(
            f"| {run['model']} | {run['config']['setting']} | {t['plain_step_ms']:.2f} | "
            f"{t['overhead_ms']:.3f} | {t['stage_sum_ms']:.3f} | {t['floor_sum_ms']:.3f} | "
            f"{_ratio(t['overhead_over_floor'])} | {_ratio(t['overhead_over_cold_floor'], 2)} | "
            f"{t['unattributed_ms']:+.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: Records, path: Path) -> None:
    """Stacked bars per model and setting, a panel per model (linear scale, so
    segment widths compare): the stages (solid) and their floors (hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = runs(records)
    names = list(dict.fromkeys(st["stage"] for r in shown for st in r["stages"]))
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap(i % 20) for i, n in enumerate(names)}
    models = list(dict.fromkeys(r["model"] for r in shown))
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 2.6 * len(models) + 0.6), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        ticks, labels = [], []
        for i, run in enumerate(r for r in shown if r["model"] == model):
            for j, key in enumerate(("ms", "floor_ms")):
                y, left = 2.2 * i + 0.8 * j, 0.0
                for st in run["stages"]:
                    width = max(st[key], 0.0)
                    ax.barh(
                        y, width, left=left, height=0.75, color=colors[st["stage"]],
                        hatch="//" if j else None, edgecolor="white" if j else None,
                    )  # fmt: skip
                    left += width
                ticks.append(y)
                labels.append(run["config"]["setting"] if j == 0 else "floor")
        ax.set_yticks(ticks, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("ms per step (amortised); hatched: the floor of each stage", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    fig.legend(handles, names, fontsize=6, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.72, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="stages",
        description="every stage of a K-FAC step (as the step times itself) beside its floor, "
        "the arithmetic on bare kernels; the stages against the measured overhead",
        measure=measure,
        options={
            "models": ["mlp", "cnn", "digits-cnn", "transformer"],
            "settings": [list(s) for s in SETTINGS],
            "steps": 20,
            "batch": 128,
            "allocator": "tuned",
        },
        quick={"models": ["tiny-mlp"], "steps": 10},
        tables={"summary": summary_table, "stages": stages_table},
        plot=plot,
    )
)
