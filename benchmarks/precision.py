"""Step time with the products in bfloat16 (``precondition_dtype``, ``factor_compute_dtype``).

The models and settings of ``step_time.py`` (784-512-512-10 MLP and a small
CNN, batch 128, factors every step, inverses every 10 steps), each run with
the products in float32 (the default) and in bfloat16: the preconditioning
products, the Gram products of the statistics, and both.  Next to each time,
what the precision costs: the preconditioned gradient of one step from the
same start against a float64 run (largest relative error and smallest cosine
over the layers), and ``memory_usage()['second_order']`` (which counts the
cast copies ``precondition_dtype`` keeps).

Subnormals are flushed to zero by default (``--denormals keep`` to see
them): the fixed batch of ``step_time.py`` is memorised within about a dozen
steps, its gradients then go subnormal, and float32 products with subnormal
operands run 50-100× slower on x86 while bfloat16 products flush them — a
comparison that would measure the data, not the products.

Prints a table and writes ``precision.json`` to ``--out``.  A CPU without
native bfloat16 products (AVX-512 BF16 / AMX) gains nothing from the option.
``--markdown memory`` prints only the second-order memory of each variant as
a markdown table (one step each, no timing, no float64 run, nothing
written): exactly reproducible, so docs/benchmarks.md holds it in a region
that ``tools/docs_check.py`` re-runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kaisa import KFACPreconditioner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import MODELS, time_steps

# eigen pinned, as in step_time.py: the rows recorded before kaisa's default
# became inverse stay comparable (and the docs say eigen)
BASE: dict[str, Any] = dict(compute_method="eigen", factor_update_steps=1, inv_update_steps=10)
BF16 = torch.bfloat16
VARIANTS: dict[str, dict[str, Any]] = {
    "float32 (default)": {},
    "precondition bf16": dict(precondition_dtype=BF16),
    "gram bf16": dict(factor_compute_dtype=BF16),
    "both bf16": dict(precondition_dtype=BF16, factor_compute_dtype=BF16),
}
#: how docs/benchmarks.md names the models and the variants
MODEL_NAMES = {"mlp-784-512-512-10": "MLP 784-512-512-10", "cnn": "CNN"}
VARIANT_NAMES = {"precondition bf16": "preconditioning bf16", "gram bf16": "Gram bf16"}


def preconditioned(model_name: str, kfac: dict[str, Any], dtype: torch.dtype, batch: int) -> dict:
    """(preconditioned gradient per layer, second-order bytes) after one step."""
    torch.manual_seed(0)
    model = MODELS[model_name]().to(dtype)
    x = torch.randn(batch, 1, 28, 28).to(dtype)  # the same data in every dtype
    y = torch.randint(0, 10, (batch,))
    precond = KFACPreconditioner(model, kl_clip=None, **BASE, **kfac)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    grads = {
        n: layer.adapter.module.weight.grad.detach().double().reshape(-1)
        for n, layer in precond.layers.items()
    }
    return {"grads": grads, "second_order": precond.memory_usage()["second_order"]}


def accuracy(got: dict, ref: dict) -> tuple[float, float]:
    errs, coss = [], []
    for name, g in got["grads"].items():
        r = ref["grads"][name]
        errs.append(float((g - r).norm() / r.norm()))
        coss.append(float(g @ r / (g.norm() * r.norm())))
    return max(errs), min(coss)


def memory_table(models: list[str], batch: int) -> list[str]:
    """Second-order bytes of every variant after one step (``memory_usage()``,
    the cast copies included), as the markdown table of docs/benchmarks.md."""
    lines = ["| model | products in | second-order bytes |", "|---|---|---|"]
    for model_name in models:
        for i, (variant, kfac) in enumerate(VARIANTS.items()):
            one = preconditioned(model_name, copy.deepcopy(kfac), torch.float32, batch)
            model = MODEL_NAMES.get(model_name, model_name) if i == 0 else ""
            name = VARIANT_NAMES.get(variant, variant)
            lines.append(f"| {model} | {name} | {one['second_order']:,} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--denormals", choices=["flush", "keep"], default="flush")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--markdown",
        choices=["memory"],
        default=None,
        help="print only the second-order memory table in markdown (no timing), write nothing",
    )
    args = parser.parse_args()
    if args.markdown == "memory":
        print("\n".join(memory_table(args.models, args.batch)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(args.denormals == "flush")
    load_before = os.getloadavg()
    rows = []
    for model_name in args.models:
        ref = preconditioned(model_name, {}, torch.float64, args.batch)
        base_ms = None
        for variant, kfac in VARIANTS.items():
            # interleave the repeats of a variant with nothing else: median of repeats
            ms = 1e3 * statistics.median(
                time_steps(model_name, {**BASE, **kfac}, args.steps, args.batch)[0]
                for _ in range(args.repeats)
            )
            base_ms = ms if base_ms is None else base_ms
            one = preconditioned(model_name, copy.deepcopy(kfac), torch.float32, args.batch)
            err, cos = accuracy(one, ref)
            rows.append(
                {
                    "model": model_name,
                    "variant": variant,
                    "step_ms": ms,
                    "speedup": base_ms / ms,
                    "max_rel_err_vs_float64": err,
                    "min_cosine_vs_float64": cos,
                    "second_order_mb": one["second_order"] / 2**20,
                }
            )
            print(
                f"{model_name:<20} {variant:<18} {ms:8.2f} ms {base_ms / ms:5.2f}x  "
                f"err {err:.1e} cos {cos:.5f}  second-order {one['second_order'] / 2**20:.1f} MB",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "settings": BASE,
        "denormals": args.denormals,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    (args.out / "precision.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
