"""The integration examples run end to end (a few steps each) and learn."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "package"),
    [("lightning_digits.py", "lightning"), ("accelerate_digits.py", "accelerate")],
)
def test_example_runs_and_learns(script: str, package: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "30", "--accumulate", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    accuracy = float(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1])
    assert accuracy > 0.8, out.stdout


def test_deepspeed_example_two_ranks(tmp_path: Path) -> None:
    """ZeRO-2 on 2 gloo ranks under torchrun (the example's documented launch)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (kaisa[deepspeed])")
    import os

    from deepspeed_case import prepare_environment

    prepare_environment()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = EXAMPLES / "deepspeed_digits.py"
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(script), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=env,
    )
    accuracy = float(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1])
    assert accuracy > 0.8, out.stdout


def test_hf_trainer_example_learns() -> None:
    """A tiny Llama from a config under the Trainer with the callback."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (kaisa[transformers])")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "hf_trainer_text.py"), "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert int(lines[-2].rsplit(" ", 1)[-1]) == 16  # embeddings, 2 blocks × 7 projections, lm_head
    before, after = (float(v) for v in lines[-1].rsplit(":", 1)[-1].split("->"))
    assert after < before - 1.0, out.stdout


def test_pipelining_example_two_stages() -> None:
    """Two stages of a ``Schedule1F1B`` under torchrun (the documented launch)."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = EXAMPLES / "pipelining_digits.py"
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node=2", str(script), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env=env,
    )
    accuracy = float(out.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1])
    assert accuracy > 0.8, out.stdout
