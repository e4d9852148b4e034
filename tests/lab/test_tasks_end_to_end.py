"""Every built-in task trains a few K-FAC steps through the real command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kaisa_lab.cli.main import main

from fakes import write_fake_cifar


@pytest.mark.parametrize(
    "task",
    ["digits-mlp", "digits-cnn", "text-lm", "cifar10", "digits-ae", "text-cnn", "text-lm-large"],
)
def test_task_trains_with_kfac(task: str, tmp_path: Path) -> None:
    args = ["train", "--task", task, "--epochs", "1", "--max-steps-per-epoch", "3", "--quiet",
            "--kfac-factor-update-steps", "1", "--kfac-inv-update-steps", "2",
            "--out", str(tmp_path / "out")]  # fmt: skip
    if task == "cifar10":
        write_fake_cifar(tmp_path / "cifar", per_batch=8, n_test=8)
        args += ["--data-dir", str(tmp_path / "cifar"), "--batch-size", "8"]
    assert main(args) == 0
    (run,) = json.loads((tmp_path / "out" / "results.json").read_text())
    assert run["kfac"] is True and run["curve"][-1]["step"] == 3
    assert math.isfinite(run["curve"][-1]["train_loss"])
    assert math.isfinite(run["final_metric"])
