"""Step time with K-FAC's products in bfloat16, and what the precision costs.

The models and settings of ``step-cost`` (784-512-512-10 MLP and small CNN,
batch 128, SGD with momentum, eigen, factors every step, inverses every 10),
each with the products in float32 (the default) and in bfloat16: the
preconditioning products (``precondition_dtype``), the Gram products of the
statistics (``factor_compute_dtype``), and both. The variants of a model are
timed in turns (:func:`~kaisa_lab.bench.timer.interleave`). Beside each
time, what the precision costs: the preconditioned gradient of one step from
the same start against a float64 run (largest relative error and smallest
cosine over the layers), and ``memory_usage()['second_order']``, which counts
the cast copies ``precondition_dtype`` keeps (+50 %). The memory is exactly
reproducible (the ``memory`` table, which docs/reports/step-cost.md renders from the
committed records); the times and errors are not.

Subnormals are flushed to zero by default (``denormals="keep"`` to see
them): gradients that go subnormal make float32 products with subnormal
operands 50–100× slower on x86 while bfloat16 products flush them — a
comparison that would measure the data, not the products. A CPU without
native bfloat16 products (AVX-512 BF16 / AMX) gains nothing from the options;
the record keeps torch's CPU capability.

    kaisa bench run precision
    kaisa bench report precision --table memory
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kaisa import KFACPreconditioner
from kaisa_lab.bench.costs.models import STEP_MODELS
from kaisa_lab.bench.costs.steps import StepArm
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register

__all__ = ["BASE", "VARIANTS", "preconditioned"]

#: the settings every variant shares (eigen pinned, as the docs' figures were measured)
BASE: dict[str, Any] = dict(compute_method="eigen", factor_update_steps=1, inv_update_steps=10)
VARIANTS: dict[str, dict[str, Any]] = {
    "float32 (default)": {},
    "preconditioning bf16": dict(precondition_dtype="bfloat16"),
    "Gram bf16": dict(factor_compute_dtype="bfloat16"),
    "both bf16": dict(precondition_dtype="bfloat16", factor_compute_dtype="bfloat16"),
}
#: how the tables name the models
MODEL_NAMES = {"mlp-784-512-512-10": "MLP 784-512-512-10", "cnn": "CNN"}


def preconditioned(
    model_name: str, kfac: Mapping[str, Any], dtype: torch.dtype, batch: int
) -> dict[str, Any]:
    """The preconditioned weight gradient of every registered layer after one step
    from the same start (same weights, same data, in ``dtype``; no KL clip), and
    the second-order bytes the preconditioner then holds."""
    torch.manual_seed(0)
    model = STEP_MODELS[model_name]().to(dtype)
    x = torch.randn(batch, 1, 28, 28).to(dtype)  # the same data in every dtype
    y = torch.randint(0, 10, (batch,))
    precond = KFACPreconditioner(model, kl_clip=None, **BASE, **kfac)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    modules = dict(model.named_modules())
    grads = {
        name: modules[name].weight.grad.detach().double().reshape(-1) for name in precond.layers
    }
    second_order = precond.memory_usage()["second_order"]
    precond.remove_hooks()
    return {"grads": grads, "second_order": second_order}


def accuracy(got: Mapping[str, Any], ref: Mapping[str, Any]) -> tuple[float, float]:
    """(largest relative error, smallest cosine) over the layers, ``got`` against ``ref``."""
    errs, coss = [], []
    for name, g in got["grads"].items():
        r = ref["grads"][name]
        errs.append(float((g - r).norm() / r.norm()))
        coss.append(float(g @ r / (g.norm() * r.norm())))
    return max(errs), min(coss)


def measure(options: Mapping[str, Any]) -> list[Row]:
    unknown = [v for v in options["variants"] if v not in VARIANTS]
    if unknown:
        raise ValueError(f"precision: unknown variants {unknown}; known: {list(VARIANTS)}")
    torch.set_flush_denormal(options["denormals"] == "flush")
    try:
        rows = []
        for model_name in options["models"]:
            ref = preconditioned(model_name, {}, torch.float64, options["batch"])
            arms = {
                variant: StepArm(model_name, {**BASE, **VARIANTS[variant]}, options["batch"])
                for variant in options["variants"]
            }
            timed = interleave(
                dict(arms), rounds=options["rounds"], block=options["block"], warmup=1
            )
            for variant, timing in timed.items():
                kfac = VARIANTS[variant]
                one = preconditioned(model_name, kfac, torch.float32, options["batch"])
                err, cos = accuracy(one, ref)
                # what the arm is (batch and subnormals: the run's options); a quick
                # run's arms are a subset of a full run's, with the same memory
                config = {"model": model_name, "variant": variant, "kfac": {**BASE, **kfac}}
                result = {
                    **timing.summary(),
                    "max_rel_err_vs_float64": err,
                    "min_cosine_vs_float64": cos,
                    "second_order_bytes": one["second_order"],
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                }
                rows.append(Row(f"{model_name} {variant}", config, result))
    finally:
        torch.set_flush_denormal(False)
    return rows


def _ordered(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    models, variants = list(STEP_MODELS), list(VARIANTS)

    def key(r: Mapping[str, Any]) -> tuple[int, int]:
        c = r["config"]
        return (
            models.index(c["model"]) if c["model"] in models else len(models),
            variants.index(c["variant"]),
        )

    return sorted(records, key=key)


def step_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Per model and precision: the step (mean ms), its speed-up over float32, the
    error and cosine against float64, and the second-order memory (MiB)."""
    ordered = _ordered(records)
    base = {
        r["config"]["model"]: r["result"]["mean_ms"]
        for r in ordered
        if r["config"]["variant"] == "float32 (default)"
    }
    lines = [
        "| model | products in | step (ms) | speed-up | error vs float64 | cosine "
        "| second-order MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    shown = None
    for r in ordered:
        c, res = r["config"], r["result"]
        model = MODEL_NAMES.get(c["model"], c["model"]) if c["model"] != shown else ""
        shown = c["model"]
        speed = f"{base[c['model']] / res['mean_ms']:.2f}" if c["model"] in base else "-"
        lines.append(
            f"| {model} | {c['variant']} | {res['mean_ms']:.1f} | {speed} | "
            f"{res['max_rel_err_vs_float64']:.1e} | {res['min_cosine_vs_float64']:.5f} | "
            f"{res['second_order_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines) + "\n"


def memory_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Second-order bytes of every variant after one step (``memory_usage()``, the
    cast copies included): deterministic."""
    lines = ["| model | products in | second-order bytes |", "|---|---|---|"]
    shown = None
    for r in _ordered(records):
        c = r["config"]
        model = MODEL_NAMES.get(c["model"], c["model"]) if c["model"] != shown else ""
        shown = c["model"]
        lines.append(f"| {model} | {c['variant']} | {r['result']['second_order_bytes']:,} |")
    return "\n".join(lines) + "\n"


CASE = register(
    TimingCase(
        name="precision",
        description="K-FAC's products in bfloat16 against float32: step time, error against "
        "float64, second-order memory (MLP, CNN; batch 128)",
        measure=measure,
        options={
            "models": list(STEP_MODELS),
            "variants": list(VARIANTS),
            "rounds": 3,
            "block": 10,
            "batch": 128,
            "denormals": "flush",
        },
        quick={"models": ["mlp-784-512-512-10"], "rounds": 1, "block": 2, "batch": 16},
        tables={"step": step_table, "memory": memory_table},
        deterministic=("second_order_bytes",),
    )
)
