"""Cost of a K-FAC step relative to a plain SGD step, on one process.

The two models and settings of the field notes (where kfac-pytorch 0.4.2
measured 7.2x and 3.9x a plain SGD step): a 784-512-512-10 MLP and a small
CNN, batch 128, factors every step, inverses every 10 steps.  Also measured:
factors every 10 steps (the CLI's default) and the inverse compute method.

Prints a table, writes ``step_time.json`` and ``step_time.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(inplace=True),
        nn.Linear(128, 10),
    )


MODELS = {"mlp-784-512-512-10": mlp, "cnn": cnn}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "sgd": None,
    "kfac f=1 inv=10": dict(factor_update_steps=1, inv_update_steps=10),
    "kfac f=10 inv=100": dict(factor_update_steps=10, inv_update_steps=100),
    "kfac inverse f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="inverse"
    ),
}


def time_steps(
    model_name: str, kfac: dict[str, Any] | None, steps: int, batch: int, device: str = "cpu"
) -> float:
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, **kfac) if kfac is not None else None
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    warmup = 3
    start = 0.0
    for i in range(steps + warmup):
        if i == warmup:
            sync()
            start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if precond is not None:
            precond.step()
        opt.step()
    sync()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (TF32 stays off)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for model_name in MODELS:
        base = None
        for variant, kfac in VARIANTS.items():
            t = statistics.median(
                time_steps(model_name, kfac, args.steps, args.batch, args.device)
                for _ in range(args.repeats)
            )
            base = t if kfac is None else base
            rows.append(
                {
                    "model": model_name,
                    "variant": variant,
                    "step_ms": 1e3 * t,
                    "ratio_to_sgd": t / base if base else 1.0,
                }
            )
            print(
                f"{model_name:<20} {variant:<26} {1e3 * t:8.2f} ms  "
                f"{rows[-1]['ratio_to_sgd']:5.2f}x",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "batch": args.batch,
        "steps": args.steps,
    }
    (args.out / "step_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['model']}\n{r['variant']}" for r in rows]
    ax.barh(range(len(rows)), [r["ratio_to_sgd"] for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("step time / SGD step time")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(args.out / "step_time.png", dpi=120)


if __name__ == "__main__":
    main()
