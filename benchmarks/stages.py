"""The cost of every stage of a K-FAC step, next to the floor of each stage.

A step splits into forward+backward (measured on a twin model without
K-FAC, interleaved step by step with the K-FAC one so machine load hits both
alike) and the stages K-FAC adds:

* capture, per layer type: the A rows (``LayerAdapter.rows_for`` of the
  inputs: the bias column; a convolution builds its patch rows in chunks
  inside the Gram, so it has one "A rows + Gram" stage), the A Gram
  (the rest of ``factor_term`` of the input factor; an Embedding's count),
  the G Gram (``factor_term`` of the output-gradient factor), and the hooks
  and sums around them (``Capture.observe`` and the gradient hook, less the
  three before);
* running average (``StepPipeline.reduce_factors``: reduction and fold);
* decomposition (``StepPipeline.update_second_order``: eigh or Cholesky);
* preconditioning products (``CurvatureMethod.apply``, or ``apply_blocks``
  where the products read and write the gradients in place);
* KL clip + write-back (``StepPipeline.apply`` less the products: reading
  the gradient, ``<V, grad>``, the scale, writing it back);
* step() bookkeeping (``step()`` less the three phases above).

The stages are timed from outside: kaisa's own methods are wrapped, on the
instances of one preconditioner, with ``time.perf_counter`` timers (CPU work is
synchronous, so a wall-clock interval is the work done in it); no library
code changes.  The same wrappers log the shape of every kernel a stage runs,
and the *floor* of the stage is then measured in the same process: the bare
kernels it cannot avoid, on random tensors of those shapes, as many times as
the stage ran them (A rows: one copy of the rows' bytes; A and G Gram: one
``kaisa.core.statistics.gram``, i.e. ``x.T @ x``, by blocks where kaisa uses them;
Embedding A: one ``bincount``; running average: one ``lerp_`` per factor;
decomposition: ``torch.linalg.eigh`` or ``cholesky`` + ``cholesky_inverse``
per dense factor; products: ``Q_Gᵀ ∇ Q_A`` and back (eigen)
or ``G⁻¹ ∇ A⁻¹`` (inverse); write-back: one copy of the gradient).

Every figure is per step, amortised over a window of steps that is a
multiple of the inverse interval, so each stage ran exactly ``window /
interval`` times in it.  The measured K-FAC overhead is the K-FAC model's
step time less the twin's, over the same window; what the stages do not
account for is printed as "unattributed".

Batches are drawn fresh each step (random inputs and labels from a pool) and
flush-to-zero is on (``torch.set_flush_denormal``): a model trained on one
fixed batch drifts into float32 denormals that slow CPU matmuls 10-20x.

Prints a table per model and setting, writes ``stages.json`` and
``stages.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from kaisa import KFACPreconditioner, tune_cpu_allocator
from kaisa.core.layer_state import KFACLayer
from kaisa.core.specs import FactorKind, FactorSource, FactorSpec
from kaisa.core.statistics import gram
from kaisa_lab.tasks.digits import DigitsCNNTask
from kaisa_lab.tasks.transformer import CharTransformer

sys.path.insert(0, str(Path(__file__).parent))
from step_time import mlp  # the 784-512-512-10 MLP of the field notes

# -- models ------------------------------------------------------------------------


def tiny_mlp() -> nn.Module:
    """A model small enough for the smoke test (``--quick``)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def cnn() -> nn.Module:
    """3 convolutions + 2 Linear layers on 3x32x32 (the Linear input is 64·4·4)."""
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


@dataclass(frozen=True)
class Case:
    """A model, how to draw a batch for it, and K-FAC options it needs."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], tuple[Tensor, Tensor]]
    kfac: dict[str, Any] = field(default_factory=dict)


def _images(shape: tuple[int, ...]) -> Callable[[int, torch.Generator], tuple[Tensor, Tensor]]:
    def draw(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(n, *shape, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    return draw


def _tokens(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


MODELS: dict[str, Case] = {
    "mlp": Case(mlp, _images((1, 28, 28))),
    "cnn": Case(cnn, _images((3, 32, 32))),
    "digits-cnn": Case(DigitsCNNTask().build_model, _images((1, 8, 8))),
    "transformer": Case(transformer, _tokens, {"loss_average": "batch_and_sequence"}),
    "tiny-mlp": Case(tiny_mlp, _images((1, 8, 8))),
}
DEFAULT_MODELS = ("mlp", "cnn", "digits-cnn", "transformer")
#: (compute_method, factor_update_steps, inv_update_steps)
SETTINGS = (("eigen", 1, 10), ("eigen", 10, 100), ("inverse", 1, 10), ("inverse", 10, 100))


def loss_of(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy over every position (the Transformer's logits are [N, T, V])."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# -- timing the stages from outside ------------------------------------------------

Kernel = tuple[Any, ...]
CAPTURE = "capture (hooks, total)"  # the sum the capture sub-stages are split from
PHASES = {
    "reduce_factors": "running average",
    "update_second_order": "decomposition",
    "apply": "apply phase",
}
STEP = "step() total"


@dataclass
class Clock:
    """Seconds and kernel logs per stage, recorded only inside the timed window."""

    recording: bool = False
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    kernels: list[tuple[str, Kernel]] = field(default_factory=list)

    def add(self, stage: str, seconds: float, *kernels: Kernel) -> None:
        if not self.recording:
            return
        self.seconds[stage] += seconds
        self.calls[stage] += 1
        self.kernels.extend((stage, k) for k in kernels)

    def need(self, stage: str, kernel: Kernel) -> None:
        """Log a kernel the stage cannot avoid, without timing anything."""
        if self.recording:
            self.kernels.append((stage, kernel))


def _flat(shape: torch.Size) -> tuple[int, int]:
    return (shape.numel() // shape[-1], shape[-1])


def _grad_rows(module: nn.Module, grad: Tensor) -> tuple[int, int]:
    """(rows, features) of an output gradient: channels are dim 1 of a convolution's."""
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        return (grad.numel() // grad.shape[1], grad.shape[1])
    return _flat(grad.shape)


def _timed(fn: Callable[..., Any], clock: Clock, stage: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        clock.add(stage, time.perf_counter() - t0)
        return out

    return wrapper


def _instrument_adapter(layer: KFACLayer, clock: Clock) -> None:
    """Split the layer's ``factor_term`` into building rows and forming the Gram.

    Only input rows count as "rows": an output gradient's rows are a view, and
    making them contiguous happens inside the Gram, where it is charged."""
    adapter = layer.adapter
    kind = type(adapter.module).__name__
    seen: dict[str, Any] = {"rows": 0.0, "shape": None}
    rows_for, factor_term = adapter.rows_for, adapter.factor_term

    def timed_rows(source: FactorSource, tensor: Tensor) -> Tensor:
        t0 = time.perf_counter()
        rows = rows_for(source, tensor)
        seen["rows"] += time.perf_counter() - t0
        seen["shape"] = rows.shape
        return rows

    def timed_term(spec: FactorSpec, tensor: Tensor, *args: Any) -> tuple[Tensor, float]:
        r0, seen["shape"] = seen["rows"], None
        t0 = time.perf_counter()
        out = factor_term(spec, tensor, *args)
        dt, rows_dt = time.perf_counter() - t0, seen["rows"] - r0
        gram = "gram" if spec.kind is FactorKind.DENSE else "sqsum"
        if spec.source is FactorSource.OUTPUT_GRAD:
            # A convolution's G Gram may read [N, C, H, W] directly, never making rows.
            shape = _grad_rows(adapter.module, tensor)
            if seen["shape"] is not None:
                shape = _flat(seen["shape"])
            clock.add(f"capture: G Gram ({kind})", dt, (gram, shape))
        elif seen["shape"] is None and hasattr(adapter, "patches"):
            # A convolution builds its patch rows chunk by chunk inside the Gram
            # (kaisa.layers.patches): one stage, whose floor is one copy of the
            # rows plus their Gram.  The shape comes from a meta-tensor view.
            view = adapter.patches(tensor.detach().to("meta"))
            rows = view.shape[: 1 + adapter.spatial_dims].numel()  # type: ignore[attr-defined]
            flat = (rows, spec.dim)
            clock.add(f"capture: A rows + Gram ({kind})", dt, ("copy", flat), (gram, flat))
        elif seen["shape"] is None:  # counted, never built (an Embedding's one-hots)
            clock.add(f"capture: A Gram ({kind})", dt, ("bincount", tensor.numel(), spec.dim))
        else:
            flat = _flat(seen["shape"])
            clock.add(f"capture: A rows ({kind})", rows_dt, ("copy", flat))
            clock.add(f"capture: A Gram ({kind})", dt - rows_dt, (gram, flat))
        return out

    adapter.rows_for = timed_rows  # type: ignore[method-assign]
    adapter.factor_term = timed_term  # type: ignore[method-assign,assignment]

    folded = layer.folded  # called for each factor after the step folds them all at once

    def logged_fold(index: int, batch: Tensor, finite: bool) -> None:
        clock.need("running average", ("lerp", tuple(layer.factors[index].shape)))
        folded(index, batch, finite)

    layer.folded = logged_fold  # type: ignore[method-assign]


def _instrument_method(precond: KFACPreconditioner, clock: Clock) -> None:
    """Time the products and log the kernels of decompositions and products."""
    method = precond._parts.method
    name = method.name
    decompose, apply, apply_blocks = method.decompose, method.apply, method.apply_blocks

    def logged_decompose(factors: Any, running: Any, which: Any, *args: Any) -> Any:
        for i in which:
            if factors[i].kind is FactorKind.DENSE:
                clock.need(
                    "decomposition", ("eigh" if name == "eigen" else "cholinv", factors[i].dim)
                )
        return decompose(factors, running, which, *args)

    def log_products(factors: Any, shape: tuple[int, ...], seconds: float) -> None:
        dims = [0] * len(shape)
        for spec in factors:
            dims[spec.axis] = spec.dim if spec.kind is FactorKind.DENSE else 0
        products = ("products", name, shape, tuple(dims))
        clock.add("preconditioning products", seconds, products)
        clock.need("KL clip + write-back", ("copy", shape))

    def timed_apply(factors: Any, state: Any, grad: Tensor, damping: float, *work: Any) -> Tensor:
        t0 = time.perf_counter()
        out = apply(factors, state, grad, damping, *work)
        log_products(factors, tuple(grad.shape), time.perf_counter() - t0)
        return out

    def timed_apply_blocks(factors: Any, state: Any, grad: list[Tensor], *rest: Any) -> Any:
        # the products read the gradients and write V where they lie; the
        # eigen method's <V, grad> (one dot of two workspace buffers) is
        # formed inside, so it is timed with them
        t0 = time.perf_counter()
        out = apply_blocks(factors, state, grad, *rest)
        shape = (int(grad[0].shape[0]), sum(int(b.shape[1]) for b in grad))
        log_products(factors, shape, time.perf_counter() - t0)
        return out

    method.decompose = logged_decompose  # type: ignore[method-assign,assignment]
    method.apply = timed_apply  # type: ignore[method-assign,assignment]
    method.apply_blocks = timed_apply_blocks  # type: ignore[method-assign,assignment]


def instrument(precond: KFACPreconditioner) -> Clock:
    """Wrap, on this preconditioner's instances only, every function a stage runs in."""
    if not precond.config.update_factors_in_hook:
        # the Gram matrices would then be formed inside reduce_factors, and
        # counted in both the capture stages and the running average
        raise ValueError("stages.py times capture inside the hooks: update_factors_in_hook=True")
    clock = Clock()
    parts = precond._parts
    for layer in parts.layers.values():
        _instrument_adapter(layer, clock)
    _instrument_method(precond, clock)
    capture = parts.capture
    capture.observe = _timed(capture.observe, clock, CAPTURE)  # type: ignore[method-assign]
    grad_hook = capture._grad_hook

    def timed_grad_hook(*args: Any) -> Callable[[Tensor], None]:
        return _timed(grad_hook(*args), clock, CAPTURE)

    capture._grad_hook = timed_grad_hook  # type: ignore[method-assign,assignment]
    pipeline = parts.pipeline
    for attr, stage in PHASES.items():
        setattr(pipeline, attr, _timed(getattr(pipeline, attr), clock, stage))
    return clock


# -- the floors: bare kernels of the same shapes ---------------------------------------


def _spd(d: int) -> Tensor:
    x = torch.randn(d, d)
    return x @ x.t() / d + 1e-3 * torch.eye(d)


def _products(method: str, shape: tuple[int, ...], dims: tuple[int, ...]) -> Callable[[], Any]:
    """``Q_Gᵀ ∇ Q_A`` and back (eigen) or ``G⁻¹ ∇ A⁻¹`` (inverse); a diagonal factor
    (dim 0) contributes no matmul.  Gradients here are matrices (axis 0: G, axis 1: A),
    or layers of one shape stacked ``[L, g, a]`` (kaisa.step.batched): batched products."""
    assert len(shape) in (2, 3), f"floor of products only for matrices, got {shape}"
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
    if kind == "gram":
        # kaisa.core.statistics.gram: by blocks on CPU from width 256 (the cheapest
        # bare Gram kaisa has), one product otherwise
        x = torch.randn(*kernel[1])
        return lambda: gram(x)
    if kind == "sqsum":
        x = torch.randn(*kernel[1])
        return lambda: (x * x).sum(0)
    if kind == "bincount":  # an Embedding's counts: a scatter into a fixed-size vector
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


#: Stages whose operands are out of cache when the step reaches them (a
#: running factor is touched once per factor step, the gradients once per
#: step): their floor is also measured cold, after evicting the caches.
COLD_STAGES = ("running average", "KL clip + write-back")


@functools.cache
def _eviction_buffer() -> Tensor:
    """64 MiB, twice this machine's L3, allocated on first use."""
    return torch.empty(16 << 20)


def _evict_caches() -> None:
    _eviction_buffer().fill_(1.0)


def cold_kernel_seconds(kernel: Kernel, cache: dict[Kernel, float], runs: int = 9) -> float:
    """Median time of one run of ``kernel`` right after the caches were evicted
    (the eviction is not timed)."""
    key = ("cold", *kernel)
    if key not in cache:
        fn = kernel_fn(kernel)
        fn()
        times = []
        for _ in range(runs):
            _evict_caches()
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


# -- one model x setting ----------------------------------------------------------------

POOL = 8  # distinct random batches, drawn in turn: no batch is ever fitted
WARMUP = 2  # steps before the window (the first decomposition, lazy allocations)


@dataclass
class Window:
    """Wall-clock sums over the timed window."""

    steps: int
    plain: float = 0.0  #: twin model without K-FAC: whole step
    plain_fwd_bwd: float = 0.0  #: twin model: forward+backward
    kfac: float = 0.0  #: K-FAC model: whole step


def window_steps(steps: int, inv: int) -> int:
    """``steps`` rounded up to a multiple of the inverse interval (so every
    stage ran exactly window / interval times in the window)."""
    return -(-max(steps, inv) // inv) * inv


def run_config(
    case: Case, method: str, f: int, inv: int, steps: int, batch: int, bar: tqdm[Any]
) -> tuple[Clock, Window]:
    """Train a K-FAC model and its plain twin side by side; time the window."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(case.build())
    model, twin = models
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        factor_update_steps=f,
        inv_update_steps=inv,
        compute_method=method,
        **case.kfac,
    )
    clock = instrument(precond)
    gen = torch.Generator().manual_seed(1)
    pool = [case.batch(batch, gen) for _ in range(POOL)]
    win = Window(window_steps(steps, inv))

    def plain_step(x: Tensor, y: Tensor) -> None:
        t0 = time.perf_counter()
        opt_twin.zero_grad()
        loss_of(twin(x), y).backward()
        t1 = time.perf_counter()
        opt_twin.step()
        if clock.recording:
            win.plain_fwd_bwd += t1 - t0
            win.plain += time.perf_counter() - t0

    def kfac_step(x: Tensor, y: Tensor) -> None:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_of(model(x), y).backward()
        t1 = time.perf_counter()
        precond.step()
        clock.add(STEP, time.perf_counter() - t1)
        opt.step()
        if clock.recording:
            win.kfac += time.perf_counter() - t0

    for i in range(WARMUP + win.steps):
        clock.recording = i >= WARMUP
        x, y = pool[i % POOL]
        first, second = (plain_step, kfac_step) if i % 2 else (kfac_step, plain_step)
        first(x, y)
        second(x, y)
        bar.update(1)
    clock.recording = False
    return clock, win


def _capture_order(stage: str) -> tuple[str, int]:
    """Capture stages by layer type, then rows, A Gram, G Gram (the order they run)."""
    part, _, kind = stage.removeprefix("capture: ").partition(" (")
    return kind, ("A rows", "A rows + Gram", "A Gram", "G Gram").index(part)


def stage_seconds(clock: Clock) -> dict[str, float]:
    """Seconds per stage over the window, the remainders formed from the totals."""
    s = clock.seconds
    capture = {k: v for k, v in s.items() if k.startswith("capture: ")}
    out = dict(sorted(capture.items(), key=lambda kv: _capture_order(kv[0])))
    out["capture: hooks and sums"] = s[CAPTURE] - sum(capture.values())
    out["running average"] = s["running average"]
    out["decomposition"] = s["decomposition"]
    out["preconditioning products"] = s["preconditioning products"]
    out["KL clip + write-back"] = s["apply phase"] - s["preconditioning products"]
    out["step() bookkeeping"] = s[STEP] - sum(s[p] for p in PHASES.values())
    return out


#: derived stages count the calls of the timer they are a remainder of
CALLS_FROM = {
    "capture: hooks and sums": CAPTURE,
    "KL clip + write-back": "apply phase",
    "step() bookkeeping": STEP,
}


def summarise(clock: Clock, win: Window, cache: dict[Kernel, float]) -> dict[str, Any]:
    """Per-step figures (ms) of one run: every stage with its floor, and the totals."""
    floors: dict[str, float] = defaultdict(float)
    cold: dict[str, float] = defaultdict(float)
    for stage, kernel in clock.kernels:
        floors[stage] += kernel_seconds(kernel, cache)
        if stage in COLD_STAGES:
            cold[stage] += cold_kernel_seconds(kernel, cache)
    per_step = 1e3 / win.steps
    stages: list[dict[str, Any]] = []
    for stage, seconds in stage_seconds(clock).items():
        ms, floor = seconds * per_step, floors.get(stage, 0.0) * per_step
        stages.append(
            {
                "stage": stage,
                "ms": ms,
                "floor_ms": floor,
                "ratio": ms / floor if floor > 0 else None,
                # the floor with the operands out of cache (= floor_ms where they fit)
                "cold_floor_ms": cold[stage] * per_step if stage in cold else floor,
                "calls": clock.calls.get(CALLS_FROM.get(stage, stage), 0),
            }
        )
    total = sum(st["ms"] for st in stages)
    floor_total = sum(st["floor_ms"] for st in stages)
    cold_total = sum(st["cold_floor_ms"] for st in stages)
    overhead = (win.kfac - win.plain) * per_step
    return {
        "window_steps": win.steps,
        "plain_step_ms": win.plain * per_step,
        "fwd_bwd_ms": win.plain_fwd_bwd * per_step,
        "kfac_step_ms": win.kfac * per_step,
        "overhead_ms": overhead,
        "stage_sum_ms": total,
        "floor_sum_ms": floor_total,
        "overhead_over_floor": total / floor_total if floor_total > 0 else None,
        "cold_floor_sum_ms": cold_total,
        "overhead_over_cold_floor": total / cold_total if cold_total > 0 else None,
        "unattributed_ms": overhead - total,
        "stages": stages,
    }


# -- output ------------------------------------------------------------------------------


def label(run: dict[str, Any]) -> str:
    return f"{run['method']} f={run['factor_steps']} inv={run['inv_steps']}"


def print_table(run: dict[str, Any]) -> None:
    """One model x setting: every stage with its floor, then the totals."""
    print(
        f"\n{run['model']} · {label(run)} · per step over {run['window_steps']} steps · "
        f"forward+backward without K-FAC {run['fwd_bwd_ms']:.2f} ms"
    )
    print(f"  {'stage':<36} {'ms/step':>9} {'floor':>9} {'x floor':>8}")
    for st in run["stages"]:
        ratio = "-" if st["ratio"] is None else f"{st['ratio']:.1f}"
        print(f"  {st['stage']:<36} {st['ms']:9.3f} {st['floor_ms']:9.3f} {ratio:>8}")
    ratio = run["overhead_over_floor"]
    print(
        f"  {'sum of stages':<36} {run['stage_sum_ms']:9.3f} {run['floor_sum_ms']:9.3f} "
        f"{'-' if ratio is None else f'{ratio:.1f}':>8}"
    )
    cold = run["overhead_over_cold_floor"]
    print(
        f"  {'  with cold memory-bound floors':<36} {'':9} {run['cold_floor_sum_ms']:9.3f} "
        f"{'-' if cold is None else f'{cold:.2f}':>8}"
    )
    print(
        f"  {'K-FAC overhead (measured)':<36} {run['overhead_ms']:9.3f}"
        f"   (unattributed {run['unattributed_ms']:+.3f})",
        flush=True,
    )


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars per model x setting, one panel per model (linear scale, so
    segment widths compare): the stages (solid) and their floors (hatched)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(dict.fromkeys(st["stage"] for r in runs for st in r["stages"]))
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap(i % 20) for i, n in enumerate(names)}
    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 2.6 * len(models) + 0.6), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in runs if r["model"] == model]
        ticks, ticklabels = [], []
        for i, run in enumerate(mine):
            for j, key in enumerate(("ms", "floor_ms")):
                y, left = 2.2 * i + 0.8 * j, 0.0
                for st in run["stages"]:
                    ax.barh(
                        y,
                        st[key],
                        left=left,
                        height=0.75,
                        color=colors[st["stage"]],
                        hatch="//" if j else None,
                        edgecolor="white" if j else None,
                    )
                    left += st[key]
                ticks.append(y)
                ticklabels.append(label(run) if j == 0 else "floor")
        ax.set_yticks(ticks, ticklabels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("ms per step (amortised); hatched: the floor of each stage", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    fig.legend(handles, names, fontsize=6, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.72, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict[str, Any]:
    """What the numbers were measured on, load included (the machine is shared)."""
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        uptime = ""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "device": "cpu",
        "flush_denormal": True,
        "loadavg": list(os.getloadavg()),
        "uptime": uptime,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


# -- main --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument(
        "--models",
        default=None,
        help=f"comma-separated, from {', '.join(MODELS)} (default: {', '.join(DEFAULT_MODELS)})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc thresholds as they are (kaisa.tune_cpu_allocator)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny MLP, 10 timed steps (100 where inv=100): a smoke test (< 30 s)",
    )
    args = parser.parse_args(argv)
    if args.models is None:
        args.models = "tiny-mlp" if args.quick else ",".join(DEFAULT_MODELS)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.steps is None:
        args.steps = 10 if args.quick else 20
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = not args.default_allocator and tune_cpu_allocator()
    torch.set_flush_denormal(True)
    total = sum(
        (WARMUP + window_steps(args.steps, inv)) for _ in args.models for _, _, inv in SETTINGS
    )
    runs: list[dict[str, Any]] = []
    cache: dict[Kernel, float] = {}
    with tqdm(total=total, desc="steps", unit="step", file=sys.stderr, leave=False) as bar:
        for name in args.models:
            for method, f, inv in SETTINGS:
                bar.set_postfix_str(f"{name} {method} f={f} inv={inv}")
                clock, win = run_config(MODELS[name], method, f, inv, args.steps, args.batch, bar)
                run = {"model": name, "method": method, "factor_steps": f, "inv_steps": inv}
                run.update(summarise(clock, win, cache))
                runs.append(run)
                bar.clear()
                print_table(run)
    meta = machine() | {"batch": args.batch, "steps": args.steps, "models": args.models}
    meta["allocator"] = "glibc, thresholds raised" if tuned else "default"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stages.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    plot(runs, args.out / "stages.png")
    print(f"\nload: {meta['uptime']}\nwrote {args.out / 'stages.json'}, {args.out / 'stages.png'}")


if __name__ == "__main__":
    main()
