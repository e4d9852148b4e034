"""``benchmarks/tune_digits.py`` on a tiny grid: every stage's rows, the pick, the outputs.

No assertion on speed (the machine is shared): what is checked is that the
sweep goes through the real CLI (each row's settings reach ``results.json``),
that the K-FAC stage builds on the winning baseline, and that ``confirm``
compares the task's defaults and the tuned pair with both arms each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_tune_digits_tiny_grid(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    args = ["--task", "digits-mlp", "--lrs", "0.05", "0.1", "--schedules", "constant:0:2"]
    args += ["cosine:0.5:2", "--dampings", "0.1", "--kl-clips", "0.001", "none"]
    args += ["--intervals", "1/10", "--seeds", "2", "--confirm-seeds", "2", "--threads", "1"]
    args += ["--kaisa-args", "--evals-per-epoch 2"]
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "tune_digits.py"),
            *args,
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    results = json.loads((tmp_path / "tune.json").read_text())
    assert len(results["baseline"]) == 4 and len(results["kfac"]) == 2
    assert len(results["confirm"]) == 4
    assert (tmp_path / "tune.png").read_bytes()[:8] == PNG_MAGIC
    for stage in ("baseline", "kfac", "confirm"):
        assert f"### {stage} (digits-mlp)" in done.stdout
    # Each baseline row's settings are what the CLI recorded for that run.
    for row in results["baseline"]:
        label = row["label"].replace(", ", "_").replace(" ", "")
        (run,) = json.loads((tmp_path / "baseline" / label / "results.json").read_text())
        assert run["kfac"] is False and len(run["seeds"]) == 2
        assert run["config"]["lr"] == row["settings"]["lr"]
        assert run["config"]["schedule"] == row["settings"]["schedule"]
        assert run["config"]["epochs"] == 2
        assert run["config"]["evals_per_epoch"] == 2  # --kaisa-args reaches every command
    # K-FAC is tuned on the winning baseline's lr and schedule.
    picked = {k: results["kfac"][0]["settings"][k] for k in ("lr", "schedule", "warmup_epochs")}
    assert all({k: r["settings"][k] for k in picked} == picked for r in results["kfac"]), results[
        "kfac"
    ]
    names = [row["name"] for row in results["confirm"]]
    assert names == ["sgd", "sgd+kfac", "sgd", "sgd+kfac"]
    assert results["confirm"][3]["settings"]["argv"][:2] == ["--lr", repr(picked["lr"])]
