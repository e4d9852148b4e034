"""Before → after for ``benchmarks/stages.py``: two trees, alternating fresh processes.

One run of the stage benchmark moves by ±0.05 in its overhead-to-floor ratio
between runs minutes apart on this shared machine, so an optimisation is
judged on several runs of each tree, interleaved: for every model, ``--rounds``
times, one process on ``--before``'s ``src`` (with that tree's own
``benchmarks/stages.py``) and one on this tree's.  The medians over the rounds
are printed per setting and stage, written to ``stages_ab.json`` and drawn
(``stages_ab.png``: each setting's K-FAC overhead over its floor, every round
a dot, the medians as bars).  ``--summarise`` reads the runs already under
``--out`` instead of running.  Nothing is asserted.

    python benchmarks/stages_ab.py --before /tmp/before --models mlp cnn --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TREES = ("before", "after")


def _run(tree: Path, model: str, out: Path, threads: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    script = tree / "benchmarks" / "stages.py"
    cmd = [sys.executable, str(script), "--models", model, "--threads", str(threads)]
    subprocess.run([*cmd, "--out", str(out)], env=env, check=True, capture_output=True)


def _runs(out: Path, tree: str, model: str) -> list[list[dict[str, Any]]]:
    """Every round's settings (each a list of the benchmark's per-setting runs)."""
    found = []
    for path in sorted(out.glob(f"{tree}-{model}-*/stages.json")):
        data = json.loads(path.read_text())
        found.append(data["runs"] if isinstance(data, dict) else data)
    return found


def _label(run: dict[str, Any]) -> str:
    return f"{run['method']} f={run['factor_steps']} inv={run['inv_steps']}"


def summarise(out: Path, models: list[str]) -> dict[str, Any]:
    """Medians over the rounds: per model and setting, the totals and every stage."""
    table: dict[str, Any] = {}
    for model in models:
        rounds = {tree: _runs(out, tree, model) for tree in TREES}
        if not all(rounds.values()):
            continue
        settings = []
        for j, first in enumerate(rounds["after"][0]):
            row: dict[str, Any] = {"setting": _label(first), "rounds": {}}
            for tree in TREES:
                runs = [r[j] for r in rounds[tree]]
                stages = {
                    st["stage"]: statistics.median(
                        next(s["ms"] for s in run["stages"] if s["stage"] == st["stage"])
                        for run in runs
                    )
                    for st in runs[0]["stages"]
                }
                row["rounds"][tree] = [run["overhead_over_floor"] for run in runs]
                row[tree] = {
                    "overhead_ms": statistics.median(run["overhead_ms"] for run in runs),
                    "floor_ms": statistics.median(run["floor_sum_ms"] for run in runs),
                    "ratio": statistics.median(row["rounds"][tree]),
                    "stages_ms": stages,
                }
            settings.append(row)
        table[model] = settings
    return table


def print_table(table: dict[str, Any]) -> None:
    for model, settings in table.items():
        for row in settings:
            b, a = row["before"], row["after"]
            print(
                f"{model} · {row['setting']}: overhead {b['overhead_ms']:.1f} → "
                f"{a['overhead_ms']:.1f} ms, floor {a['floor_ms']:.1f} ms, overhead/floor "
                f"{b['ratio']:.2f} → {a['ratio']:.2f} (rounds "
                + " ".join(f"{r:.2f}" for r in row["rounds"]["before"])
                + " → "
                + " ".join(f"{r:.2f}" for r in row["rounds"]["after"])
                + ")"
            )
            for stage, ms in a["stages_ms"].items():
                print(f"    {stage:<38} {b['stages_ms'].get(stage, float('nan')):8.3f} → {ms:8.3f}")


def plot(table: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(4.2 * len(table), 3.4), squeeze=False)
    for ax, (model, settings) in zip(axes[0], table.items()):
        for i, row in enumerate(settings):
            for k, tree in enumerate(TREES):
                x = i + (k - 0.5) * 0.38
                ax.bar(x, row[tree]["ratio"], 0.36, color=("#bbbbbb", "#3a7bd5")[k])
                ax.plot([x] * len(row["rounds"][tree]), row["rounds"][tree], "k.", ms=3)
        ax.axhline(1.15, color="r", lw=0.8, ls="--")
        ax.set_xticks(range(len(settings)), [r["setting"] for r in settings], rotation=25)
        ax.tick_params(labelsize=7)
        ax.set_ylim(0.8, None)
        ax.set_title(f"{model}: K-FAC overhead / floor (grey before, blue after)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a kaisa tree (src/, benchmarks/)")
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/stages-ab"))
    parser.add_argument("--summarise", action="store_true", help="read --out, run nothing")
    args = parser.parse_args(argv)
    if not args.summarise:
        if args.before is None:
            parser.error("--before TREE is needed unless --summarise")
        from tqdm import tqdm

        jobs = [(m, i, t) for m in args.models for i in range(1, args.rounds + 1) for t in TREES]
        for model, i, tree in tqdm(jobs, desc="stage runs", file=sys.stderr):
            root = args.before if tree == "before" else HERE.parent
            _run(root, model, args.out / f"{tree}-{model}-{i}", args.threads)
    table = summarise(args.out, args.models)
    print_table(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stages_ab.json").write_text(json.dumps(table, indent=1))
    plot(table, args.out / "stages_ab.png")
    print(f"wrote {args.out / 'stages_ab.json'} and {args.out / 'stages_ab.png'}")


if __name__ == "__main__":
    main()
