"""Capture cost of the convolution factors, before and after a change.

The CNN of ``step_time.py`` on 3×32×32 inputs (3 conv + 2 linear), batch 128:
per factor step, the time of each conv layer's A and G terms on the tensors a
real forward/backward delivered (what the hooks spend on them), and the whole
step with (factor, inverse) intervals (1, 10) — its mean over the timed steps
(inverse steps amortised) and its median (a factor step without an inverse).

``--before DIR`` compares: it alternates fresh processes of this script on
``DIR/src`` (e.g. ``git archive <rev> src | tar -x -C DIR``) and on the
``src`` next to this file, ``--rounds`` times, prints a before → after table
of medians over the rounds and writes ``conv_capture.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BATCH_SHAPE = (3, 32, 32)


def cnn() -> nn.Module:
    """``step_time.cnn`` with 3 input channels and 32×32 inputs."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(inplace=True),
        nn.Linear(128, 10),
    )


def conv_tensors(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Each conv's input and output gradient from one forward/backward."""
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


def median_ms(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(batch: int, steps: int, reps: int) -> dict[str, float]:
    """One process's figures for the kaisa on ``sys.path``."""
    from kaisa import KFACPreconditioner
    from kaisa.core.specs import FactorSource

    torch.manual_seed(0)
    model = cnn()
    x, y = torch.randn(batch, *BATCH_SHAPE), torch.randint(0, 10, (batch,))
    tensors = conv_tensors(model, x, y)  # before the preconditioner hooks in
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, factor_update_steps=1, inv_update_steps=10)
    out: dict[str, float] = {}
    for source, label in ((FactorSource.INPUT, "A"), (FactorSource.OUTPUT_GRAD, "G")):
        total = 0.0
        for name, (inp, grad) in tensors.items():
            layer = precond.layers[name]
            spec = next(s for s in layer.factors if s.source is source)
            t = inp if source is FactorSource.INPUT else grad
            term = partial(layer.adapter.factor_term, spec, t, layer.factor_dtype)
            ms = median_ms(term, reps)
            out[f"{label} {name}"] = ms
            total += ms
        out[f"{label} terms (3 conv)"] = total
    out["capture terms (A+G)"] = out["A terms (3 conv)"] + out["G terms (3 conv)"]
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    out["step mean f=1 inv=10"] = 1e3 * statistics.fmean(times)
    out["step median f=1 inv=10"] = 1e3 * statistics.median(times)
    return out


def compare(args: argparse.Namespace) -> None:
    trees = {"before": Path(args.before) / "src", "after": Path(__file__).parents[1] / "src"}
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for label, src in trees.items():
            env = dict(os.environ, PYTHONPATH=str(src))
            cmd = [sys.executable, __file__, "--single", "--threads", str(args.threads)]
            cmd += ["--batch", str(args.batch), "--steps", str(args.steps)]
            cmd += ["--reps", str(args.reps)]
            done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {label}: {runs[label][-1]}", flush=True)
    rows = []
    for metric in runs["after"][0]:
        before = statistics.median(run[metric] for run in runs["before"])
        after = statistics.median(run[metric] for run in runs["after"])
        rows.append({"metric": metric, "before_ms": before, "after_ms": after})
    print(f"\n{'metric':<28} {'before ms':>10} {'after ms':>10} {'after/before':>13}")
    for row in rows:
        ratio = row["after_ms"] / row["before_ms"]
        print(f"{row['metric']:<28} {row['before_ms']:10.1f} {row['after_ms']:10.1f} {ratio:13.2f}")
    meta = {
        "torch": torch.__version__,
        "threads": args.threads,
        "batch": args.batch,
        "steps": args.steps,
        "reps": args.reps,
        "rounds": args.rounds,
        "loadavg_at_start": args.loadavg,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conv_capture.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--before", help="a kaisa tree (with src/) to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.single:
        print(json.dumps(measure(args.batch, args.steps, args.reps)))
        return
    args.loadavg = os.getloadavg()
    if args.before:
        compare(args)
    else:
        figures = measure(args.batch, args.steps, args.reps)
        for metric, ms in figures.items():
            print(f"{metric:<28} {ms:10.1f} ms")
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "threads": args.threads, "batch": args.batch}
        (args.out / "conv_capture.json").write_text(
            json.dumps({"meta": meta | {"steps": args.steps}, "figures": figures}, indent=2)
        )


if __name__ == "__main__":
    main()
