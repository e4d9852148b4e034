"""The capture cost of the convolution factors.

The CNN of :func:`kaisa_lab.bench.costs.models.cnn32` (3×32×32 inputs; conv
3→32, 32→32, pool, 32→64, pool, Linear 4096→128, Linear 128→10), batch
128, float32. Per factor step:

- each convolution's A and G term (``layer.adapter.factor_term``, what the
  hooks spend on it) on the tensors a real forward and backward delivered,
  all terms timed in turns (``reps`` rounds), and their sums;
- the whole training step with factors every step and inverses every 10:
  its mean (inverse steps amortised) and its median (a factor step without
  a decomposition).

A convolution's A term is the Gram of its patches, formed without building
the unfolded rows: the input padded once into channels-last layout, each
patch a strided view copied a few images at a time into one cache-sized
buffer whose last column holds the bias's ones, the chunks' Grams summed and
only the ``d×d`` result permuted to the weight's order
(:mod:`kaisa.layers.patches`); G is ``Σ_n g_n g_nᵀ`` of the gradient as it
lies. Measured so, the 32→32 conv's A term is close to its Gram alone (a
131072 × 290 product), and the step saves what the capture saves; the rest
of the step is the Linear 4096→128 layer's 4097² factor (its products and,
every tenth step, its decomposition).

A change to the capture is judged before and after, in alternating fresh
processes: ``kaisa bench ab conv-capture --before REV``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.core.specs import FactorSource
from kaisa_lab.bench.costs.models import cnn32
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register

__all__ = ["conv_tensors"]

#: the settings of the timed step
STEP: dict[str, Any] = dict(factor_update_steps=1, inv_update_steps=10)
STEP_ARM = "step f=1 inv=10"
SUMS = {"A": "A, the convs", "G": "G, the convs"}
TOTAL = "capture terms, A + G"


def conv_tensors(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Each convolution's input and output gradient from one forward and backward."""
    seen: dict[str, list[Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):

            def hook(mod: nn.Module, inp: Any, out: Tensor, name: str = name) -> None:
                seen[name] = [inp[0].detach()]
                out.register_hook(lambda g: seen[name].append(g.detach()))

            handles.append(module.register_forward_hook(hook))
    F.cross_entropy(model(x), y).backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    return {name: (t[0], t[1]) for name, t in seen.items()}


def measure(options: Mapping[str, Any]) -> list[Row]:
    torch.manual_seed(0)
    model = cnn32()
    batch = options["batch"]
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    tensors = conv_tensors(model, x, y)  # before the preconditioner hooks in
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, **STEP)
    modules = dict(model.named_modules())
    terms: dict[str, Callable[[], object]] = {}
    described: dict[str, dict[str, Any]] = {}
    for source, factor in ((FactorSource.INPUT, "A"), (FactorSource.OUTPUT_GRAD, "G")):
        for name, (inp, grad) in tensors.items():
            layer = precond.layers[name]
            spec = next(s for s in layer.factors if s.source is source)
            t = inp if source is FactorSource.INPUT else grad
            terms[f"{factor} {name}"] = partial(
                layer.adapter.factor_term, spec, t, layer.factor_dtype, 1.0
            )
            conv = modules[name]
            assert isinstance(conv, nn.Conv2d)
            described[f"{factor} {name}"] = {
                "factor": factor,
                "layer": name,
                "in_channels": conv.in_channels,
                "out_channels": conv.out_channels,
                "width": spec.dim,
                "size": list(t.shape[-2:]),
            }
    timed = interleave(terms, rounds=options["reps"], warmup=1)
    rows = []
    sums = {factor: {"median_ms": 0.0, "mean_ms": 0.0} for factor in SUMS}
    for arm, timing in timed.items():
        rows.append(Row(arm, {**described[arm], "batch": batch}, timing.summary()))
        sums[described[arm]["factor"]]["median_ms"] += timing.median_ms
        sums[described[arm]["factor"]]["mean_ms"] += timing.mean_ms
    for factor, label in SUMS.items():
        rows.append(Row(label, {"factor": factor, "sum": True, "batch": batch}, sums[factor]))
    total = {k: sums["A"][k] + sums["G"][k] for k in ("median_ms", "mean_ms")}
    rows.append(Row(TOTAL, {"factor": "A+G", "sum": True, "batch": batch}, total))

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()

    (timing,) = interleave(
        {STEP_ARM: step}, rounds=options["rounds"], block=options["block"], warmup=1
    ).values()
    rows.append(Row(STEP_ARM, {"kfac": STEP, "batch": batch}, timing.summary()))
    return rows


def table(records: Sequence[Mapping[str, Any]]) -> str:
    """Per factor step: each conv's A and G terms (median ms), their sums, and the step."""
    by_arm = {r["arm"]: r for r in records}
    lines = ["| per factor step | ms |", "|---|---|"]
    for factor in SUMS:
        terms = sorted(
            (r for r in records if r["config"].get("factor") == factor and "layer" in r["config"]),
            key=lambda r: int(r["config"]["layer"]) if r["config"]["layer"].isdigit() else 0,
        )
        for r in terms:
            c = r["config"]
            h, w = c["size"]
            label = f"{factor}, conv {c['in_channels']}→{c['out_channels']} ({c['width']} wide"
            lines.append(f"| {label}, {h}×{w}) | {r['result']['median_ms']:.1f} |")
    for label in (*SUMS.values(), TOTAL):
        if label in by_arm:
            lines.append(f"| {label} | {by_arm[label]['result']['median_ms']:.1f} |")
    if STEP_ARM in by_arm:
        res = by_arm[STEP_ARM]["result"]
        lines.append(f"| step, mean (f=1 inv=10) | {res['mean_ms']:.1f} |")
        lines.append(f"| step, median (a factor step) | {res['median_ms']:.1f} |")
    return "\n".join(lines) + "\n"


CASE = register(
    TimingCase(
        name="conv-capture",
        description="each convolution's A and G capture terms and the step (CNN on 3×32×32, "
        "batch 128, f=1 inv=10)",
        measure=measure,
        options={"batch": 128, "reps": 5, "rounds": 2, "block": 10},
        quick={"batch": 8, "reps": 1, "rounds": 1, "block": 2},
        tables={"capture": table},
    )
)
