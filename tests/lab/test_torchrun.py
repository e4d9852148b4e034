"""`kaisa compare` under torchrun: two gloo ranks, only rank 0 writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_cli import tree_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(("fraction", "seeds"), [("mem-opt", 1), ("comm-opt", 2)])
def test_compare_under_torchrun(tmp_path, fraction: str, seeds: int) -> None:
    out = tmp_path / "run"
    env = tree_env(OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--standalone", "-m", "kaisa", "compare", "--task", "digits-mlp",
        "--epochs", "2", "--max-steps-per-epoch", "5", "--quiet", "--threads", "1",
        "--kfac-grad-worker-fraction", fraction, "--pg-timeout-s", "60", "--seeds", str(seeds),
        "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "results.json").read_text())
    assert [r["kfac"] for r in runs] == [False, True]
    for run in runs:
        assert run["config"]["world_size"] == 2
        assert len(run["curve"]) == 2
        assert run["curve"][-1]["step"] == 10
        assert [s["seed"] for s in run["seeds"]] == list(range(seeds))
        assert run["summary"]["n_seeds"] == seeds
    assert runs[0]["config"]["kfac"] is None
    assert runs[1]["config"]["kfac"]["grad_worker_fraction"] == fraction
    # only rank 0 prints the table
    assert proc.stdout.count("epochs to target") == 1 and proc.stdout.count("wrote ") == 1
