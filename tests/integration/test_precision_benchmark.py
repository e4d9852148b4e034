"""Smoke test of ``benchmarks/precision.py`` (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_precision_benchmark_writes_every_variant(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "precision.py"), "--out", str(tmp_path)]
    command += ["--steps", "1", "--repeats", "1", "--models", "mlp-784-512-512-10"]
    subprocess.run(command, check=True, env=env, timeout=300, capture_output=True)
    rows = json.loads((tmp_path / "precision.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "float32 (default)",
        "precondition bf16",
        "gram bf16",
        "both bf16",
    ]
    default, precondition = rows[0], rows[1]
    assert default["max_rel_err_vs_float64"] < 1e-3 < precondition["max_rel_err_vs_float64"]
    # the cached bfloat16 copies: half the bytes of the float32 tensors on top
    assert precondition["second_order_mb"] == 1.5 * default["second_order_mb"]
