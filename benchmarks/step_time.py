"""Cost of a K-FAC step relative to a plain SGD step, on one process.

The two models and settings of the field notes (where kfac-pytorch 0.4.2
measured 7.2x and 3.9x a plain SGD step): a 784-512-512-10 MLP and a small
CNN, batch 128, factors every step, inverses every 10 steps.  Also measured:
factors every 10 steps (the CLI's default) and the inverse compute method.

With ``--reference-src PATH`` (a checkout of kfac-pytorch, whose ``kfac``
package is imported from PATH; never vendored here) every K-FAC variant is
also timed with ``kfac.preconditioner.KFACPreconditioner`` under the same
keywords, side by side.

Batches are drawn fresh from a small pool: a step repeated on one fixed batch
drives the gradients into denormal floats, which make CPU matrix products
10–20× slower and would inflate every K-FAC row.

Prints a table, writes ``step_time.json`` and ``step_time.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner, tune_cpu_allocator


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
    # activations not in place: kfac-pytorch's full backward hooks refuse an
    # in-place op right after a layer, and both libraries must time one model
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


MODELS = {"mlp-784-512-512-10": mlp, "cnn": cnn}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "sgd": None,
    # eigen pinned: the rows recorded before kaisa's default became inverse stay comparable
    "kfac f=1 inv=10": dict(factor_update_steps=1, inv_update_steps=10, compute_method="eigen"),
    "kfac f=10 inv=100": dict(factor_update_steps=10, inv_update_steps=100, compute_method="eigen"),
    "kfac inverse f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="inverse"
    ),
    # precond.compile(mode="reduce-overhead"): non-factor steps replayed as a
    # CUDA graph (kaisa.step.graphed); a GPU variant, left out of CPU defaults
    "kfac f=10 inv=100 replayed": dict(
        factor_update_steps=10, inv_update_steps=100, compute_method="eigen"
    ),
}
#: variants timed with ``precond.compile(mode="reduce-overhead")`` (kaisa only)
REPLAYED = frozenset({"kfac f=10 inv=100 replayed"})


Preconditioner = Callable[..., Any]
POOL = 8  # distinct batches cycled through (no denormal drift, no data loading cost)


def time_steps(
    model_name: str,
    kfac: dict[str, Any] | None,
    steps: int,
    batch: int,
    device: str = "cpu",
    preconditioner: Preconditioner = KFACPreconditioner,
    replayed: bool = False,
) -> tuple[float, float]:
    """Seconds per step and page faults per step (``replayed``: kaisa's
    non-factor steps replayed as CUDA graphs)."""
    torch.manual_seed(0)
    model = MODELS[model_name]().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = preconditioner(model, **_keywords(preconditioner, kfac, opt)) if kfac else None
    if replayed and precond is not None:
        precond.compile(mode="reduce-overhead")
    xs = torch.randn(POOL, batch, 1, 28, 28, device=device)
    ys = torch.randint(0, 10, (POOL, batch), device=device)
    sync = torch.cuda.synchronize if xs.is_cuda else (lambda: None)
    warmup = 3
    start, faults = 0.0, 0
    for i in range(steps + warmup):
        if i == warmup:
            sync()
            start, faults = time.perf_counter(), minor_faults()
        opt.zero_grad()
        F.cross_entropy(model(xs[i % POOL]), ys[i % POOL]).backward()
        if precond is not None:
            precond.step()
        opt.step()
    sync()
    return (time.perf_counter() - start) / steps, (minor_faults() - faults) / steps


def _ratio(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.2f}x"


def minor_faults() -> int:
    """Pages this process has faulted in so far (0 where ``resource`` is missing):
    on CPU, fresh allocations the C allocator had handed back to the system
    are faulted in again, page by page (kaisa.core.workspace)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _keywords(
    preconditioner: Preconditioner, kfac: dict[str, Any], opt: torch.optim.Optimizer
) -> dict[str, Any]:
    """kaisa reads the learning rate from the optimizer; kfac-pytorch takes ``lr``."""
    if preconditioner is KFACPreconditioner:
        return kfac | {"optimizer": opt}
    return kfac | {"lr": opt.param_groups[0]["lr"]}


def reference_preconditioner(src: Path) -> Preconditioner:
    """kfac-pytorch's ``KFACPreconditioner`` from a checkout at ``src``.

    A source checkout that was never pip-installed has no package metadata,
    which its ``kfac/__init__.py`` reads for ``__version__``; then the package
    is entered without running that file (its submodules import as usual)."""
    sys.path.insert(0, str(src))
    try:
        module = importlib.import_module("kfac.preconditioner")
    except importlib.metadata.PackageNotFoundError:
        for name in [n for n in sys.modules if n == "kfac" or n.startswith("kfac.")]:
            del sys.modules[name]
        package = importlib.util.module_from_spec(
            importlib.machinery.ModuleSpec("kfac", None, is_package=True)
        )
        package.__path__ = [str(src / "kfac")]
        sys.modules["kfac"] = package
        module = importlib.import_module("kfac.preconditioner")
    except ImportError as exc:
        message = f"--reference-src {src}: cannot import kfac.preconditioner ({exc})"
        raise SystemExit(message) from exc
    return module.KFACPreconditioner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="leave glibc's malloc thresholds as they are (kaisa.tune_cpu_allocator)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (TF32 stays off)")
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="models to time"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=None,
        help="variants to time (ratios need 'sgd' among them; default: all, the "
        "replayed one on CUDA only)",
    )
    parser.add_argument(
        "--reference-src",
        type=Path,
        default=None,
        help="a kfac-pytorch checkout: time its KFACPreconditioner beside kaisa's",
    )
    args = parser.parse_args()
    if args.variants is None:
        cuda = args.device.startswith("cuda")
        args.variants = [v for v in VARIANTS if cuda or v not in REPLAYED]
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = not args.default_allocator and tune_cpu_allocator()
    libraries: dict[str, Preconditioner] = {"kaisa": KFACPreconditioner}
    if args.reference_src is not None:
        libraries["kfac-pytorch"] = reference_preconditioner(args.reference_src)
    rows = []
    for model_name in args.models:
        base = None
        for variant in args.variants:
            kfac = VARIANTS[variant]
            for library, preconditioner in libraries.items():
                if (kfac is None or variant in REPLAYED) and library != "kaisa":
                    continue  # one SGD baseline; graphs are kaisa's
                try:
                    runs = [
                        time_steps(
                            *(model_name, kfac, args.steps, args.batch, args.device),
                            preconditioner,
                            replayed=variant in REPLAYED,
                        )
                        for _ in range(args.repeats)
                    ]
                    t = statistics.median(r[0] for r in runs)
                    faults = statistics.median(r[1] for r in runs)
                except Exception as exc:  # the reference's own failure, reported
                    print(f"{model_name:<20} {variant:<26} {library:<13} failed: {exc}")
                    continue
                base = t if kfac is None else base
                rows.append(
                    {
                        "model": model_name,
                        "variant": variant,
                        "library": library if kfac is not None else "torch",
                        "step_ms": 1e3 * t,
                        "ratio_to_sgd": t / base if base else None,  # no SGD row timed
                        "page_faults_per_step": faults,
                    }
                )
                print(
                    f"{model_name:<20} {variant:<26} {rows[-1]['library']:<13} {1e3 * t:8.2f} ms  "
                    f"{_ratio(rows[-1]['ratio_to_sgd'])}  {faults:8.0f} faults/step",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "allocator": "glibc, thresholds raised" if tuned else "default",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "batch": args.batch,
        "steps": args.steps,
        "reference_src": str(args.reference_src) if args.reference_src else None,
    }
    (args.out / "step_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in rows if r["ratio_to_sgd"] is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * len(rows)))
    labels = [f"{r['model']} {r['variant']} ({r['library']})" for r in rows]
    ax.barh(range(len(rows)), [r["ratio_to_sgd"] for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel("step time / SGD step time")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(args.out / "step_time.png", dpi=120)


if __name__ == "__main__":
    main()
