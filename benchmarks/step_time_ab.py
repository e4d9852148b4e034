"""``step_time.py`` before and after a change, interleaved in fresh processes.

A redesign must not slow the step.  On a shared machine one run of
``step_time.py`` moves by ±20 %, so this runs it for two source trees
alternately — before, after, before, after, … — each in a fresh interpreter
with that tree's ``src`` first on ``PYTHONPATH`` (the benchmark script itself
is this checkout's, so both sides time the same models), and reports the
median of the rounds per row and the after/before ratio.

    git worktree add /tmp/before <rev>
    python benchmarks/step_time_ab.py --before /tmp/before --after . --rounds 5

Prints a table, writes ``step_time_ab.json`` and ``step_time_ab.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

HERE = Path(__file__).resolve().parent


def _run(tree: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One ``step_time.py`` run with ``tree/src`` first on the path: its rows."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            str(HERE / "step_time.py"),
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--repeats",
            "1",
            "--threads",
            str(args.threads),
            "--models",
            *args.models,
            "--variants",
            *args.variants,
        ]
        env = dict(os.environ, PYTHONPATH=str(tree.resolve() / "src"), MPLBACKEND="Agg")
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        rows: list[dict[str, Any]] = json.loads((Path(out) / "step_time.json").read_text())["rows"]
        return rows


def _table(samples: dict[str, dict[tuple[str, str], list[float]]]) -> list[dict[str, Any]]:
    keys = list(samples["before"])
    table = []
    for model, variant in keys:
        before = samples["before"][(model, variant)]
        after = samples["after"].get((model, variant), [])
        mb, ma = statistics.median(before), statistics.median(after)
        table.append(
            {
                "model": model,
                "variant": variant,
                "before_ms": before,
                "after_ms": after,
                "before_median_ms": mb,
                "after_median_ms": ma,
                "ratio": ma / mb,
            }
        )
    return table


def _plot(table: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.4 * len(table)))
    labels = [f"{r['model']} {r['variant']}" for r in table]
    ax.barh(labels, [r["ratio"] for r in table], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("after / before (median step time)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout before the change")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="checkout after it")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=["mlp-784-512-512-10", "cnn"])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["sgd", "kfac f=1 inv=10", "kfac f=10 inv=100", "kfac inverse f=1 inv=10"],
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    for side in ("before", "after"):
        if not (getattr(args, side) / "src" / "kaisa").is_dir():
            parser.error(f"--{side} {getattr(args, side)}: no src/kaisa in it")
    samples: dict[str, dict[tuple[str, str], list[float]]] = {"before": {}, "after": {}}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for side in ("before", "after"):
            for row in _run(getattr(args, side), args):
                key = (row["model"], row["variant"])
                samples[side].setdefault(key, []).append(row["step_ms"])
    table = _table(samples)
    print(f"{'model':<20} {'variant':<24} {'before ms':>10} {'after ms':>10} {'after/before':>13}")
    for r in table:
        print(
            f"{r['model']:<20} {r['variant']:<24} {r['before_median_ms']:10.2f} "
            f"{r['after_median_ms']:10.2f} {r['ratio']:13.3f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"rounds": args.rounds, "steps": args.steps, "threads": args.threads}
    meta |= {"before": str(args.before), "after": str(args.after)}
    payload = {"meta": meta, "rows": table}
    (args.out / "step_time_ab.json").write_text(json.dumps(payload, indent=2))
    _plot(table, args.out / "step_time_ab.png")


if __name__ == "__main__":
    main()
