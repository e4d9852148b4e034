"""kfac-pytorch's own example scripts run against kaisa, changed by one import (issue 21).

kfac-pytorch's ``examples/`` folder is copied from ``../shared/kfac-pytorch``
into ``tmp_path`` at run time (never into the project) and the only edit made
to it is the preconditioner's class: ``kfac.preconditioner.KFACPreconditioner(``
becomes kaisa's ``KFACPreconditioner(`` (one ``from kaisa import`` line added).
Everything else — ``kfac.enums``, ``kfac.scheduler.LambdaParamScheduler``, the
checkpoint code that calls ``preconditioner.state_dict()`` on rank 0 only,
``print(preconditioner)`` — stays kfac-pytorch's, imported from its source.
The packages the examples import that do not install beside this torch
(torchvision, torchtext, torchinfo, tensorboard) are small stand-ins in
``tests/kfac_pytorch_stubs`` (see its README), on synthetic data of the real
shapes.  Each script runs under torchrun on 1 and 2 gloo ranks; the CIFAR-10
one writes a checkpoint every epoch and each later launch resumes from the
last (2 ranks → 2 ranks → 1 rank).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kfac_pytorch_source import kfac_pytorch_env, require_kfac_pytorch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STUBS = Path(__file__).resolve().parents[1] / "kfac_pytorch_stubs"
RUN_TIMEOUT_S = 120
#: the call both examples make, and what it becomes
CALL = "kfac.preconditioner.KFACPreconditioner("
KAISA_CALL = "KFACPreconditioner("
KFAC_IMPORT = "\nimport kfac\n"
KAISA_IMPORT = "from kaisa import KFACPreconditioner\n"
EDITED = ("vision/optimizers.py", "torch_language_model.py")
#: tqdm's progress postfix, e.g. "loss: 2.3026, acc: 9.38%" (not "val_loss:")
PRINTED_LOSS = re.compile(r"\bloss: ([^\s,]+)")


def _swap_preconditioner(text: str, name: str) -> str:
    """The one edit: kfac-pytorch's preconditioner class → kaisa's (checked to be all)."""
    assert text.count(CALL) == 1, f"{name}: expected one {CALL!r}"
    assert text.count(KFAC_IMPORT) == 1, f"{name}: expected one {KFAC_IMPORT.strip()!r}"
    edited = text.replace(CALL, KAISA_CALL).replace(KFAC_IMPORT, KFAC_IMPORT + KAISA_IMPORT)
    assert edited.replace(KAISA_IMPORT, "").replace(KAISA_CALL, CALL) == text
    return edited


@pytest.fixture(scope="module")
def examples_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The launch environment: the edited copy of ``examples/`` first on the path,
    then the stand-ins, kfac-pytorch's source (with package metadata) and kaisa."""
    source = require_kfac_pytorch()
    root = tmp_path_factory.mktemp("kfac_pytorch_examples")
    shutil.copytree(source / "examples", root / "examples")
    for name in EDITED:
        path = root / "examples" / name
        path.write_text(_swap_preconditioner(path.read_text(), name))
    return kfac_pytorch_env(source, root, root, STUBS)


def _torchrun(env: dict[str, str], cwd: Path, nproc: int, module: str, args: list[str]) -> str:
    """Launch ``module`` on ``nproc`` gloo ranks; its stdout + stderr, or fail showing them.

    A launch in which a rank was killed by a signal is run once more from
    the same ``logs/`` folder, with a warning that shows the first launch's
    log; any other failure, or a second signal, fails.  Why: on clean-clone
    CI runs rank 1 sometimes aborts *at interpreter exit*, after training and
    validation, while rank 0 still writes its checkpoint ("terminate called
    without an active exception", no Python frame: a C++ thread destroyed
    while joinable; the examples never call ``destroy_process_group``).  Not
    reproduced in 8 local runs; an open defect (session 12's note), which
    the warning keeps visible.  Python's faulthandler is on in the ranks.
    PyTorch knows this abort: a process that exits without
    ``destroy_process_group`` can leave gloo's worker threads holding work
    objects whose tensors are freed during interpreter finalization
    (pytorch/pytorch#190489, open; the atexit handler proposed for it,
    pytorch/pytorch#179291, was abandoned).  kaisa does not destroy the
    user's process group for them.
    """
    logs = cwd / "logs"
    before = cwd / "logs.before"
    shutil.rmtree(before, ignore_errors=True)
    if logs.exists():
        shutil.copytree(logs, before)
    code, out, err = _launch({**env, "PYTHONFAULTHANDLER": "1"}, cwd, nproc, module, args)
    if code != 0 and _SIGNALLED.search(err):
        warnings.warn(
            f"{module} on {nproc} ranks: a rank was killed by a signal; launched again\n"
            f"{_tail(out, err)}",
            stacklevel=2,
        )
        shutil.rmtree(logs, ignore_errors=True)
        if before.exists():
            shutil.copytree(before, logs)
        code, out, err = _launch({**env, "PYTHONFAULTHANDLER": "1"}, cwd, nproc, module, args)
    if code != 0:
        pytest.fail(f"{module} on {nproc} ranks: exit {code}\n{_tail(out, err)}")
    return out + err


#: torchrun's report of a rank that died by a signal ("exitcode  : -6 (pid: ...)")
_SIGNALLED = re.compile(r"exitcode\s*:\s*-\d+")


def _launch(
    env: dict[str, str], cwd: Path, nproc: int, module: str, args: list[str]
) -> tuple[int, str, str]:
    """One torchrun launch: its exit code, stdout and stderr (fails on a hang)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(STUBS / "run_example.py"), module, *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        pytest.fail(
            f"{module} on {nproc} ranks: no exit within {RUN_TIMEOUT_S} s\n{_tail(out, err)}"
        )
    return proc.returncode, out, err


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """End a hung launch: SIGTERM lets torchrun end its ranks (each in a session of its
    own); SIGKILL to the launcher's session only if it does not exit."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate(timeout=30)


def _tail(out: str, err: str) -> str:
    """The ends of both streams, without the lines that crowd out a failure's cause
    (torch's environment report, which the example prints, and kfac's Apex warning)."""
    out = out.split("Global rank 0 initialized", 1)[-1] if "Collecting env info" in out else out
    err = "\n".join(
        line for line in err.splitlines() if "NVIDIA Apex" not in line and "get_rank" not in line
    )
    return f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-8000:]}"


def _printed_losses(output: str) -> list[float]:
    losses = [float(v) for v in PRINTED_LOSS.findall(output)]
    assert losses, f"no loss printed:\n{output[-3000:]}"
    return losses


# -- CIFAR-10 / ResNet-20 ------------------------------------------------------------
TRAIN_IMAGES = 128  # tests/kfac_pytorch_stubs/torchvision/datasets.py
BATCH = 16
DAMPING = 0.003
RESNET20_LAYERS = 20  # 19 Conv2d + 1 Linear


def _cifar_args(tmp_path: Path, epochs: int) -> list[str]:
    return [
        "--backend", "gloo", "--no-cuda", "--model", "resnet20", "--epochs", str(epochs),
        "--batch-size", str(BATCH), "--val-batch-size", str(BATCH),
        "--data-dir", str(tmp_path / "data"), "--log-dir", str(tmp_path / "logs"),
        "--checkpoint-freq", "1", "--kfac-strategy", "mem-opt",
        "--kfac-factor-update-steps", "1", "--kfac-inv-update-steps", "2",
        "--kfac-damping", str(DAMPING),
        # kfac's LambdaParamScheduler halves the damping and doubles both
        # intervals after every epoch from the first on
        "--kfac-damping-decay", "1", "--kfac-update-steps-decay", "1",
        "--kfac-update-steps-alpha", "2",
    ]  # fmt: skip


def _checkpoint(tmp_path: Path, epoch: int) -> dict:
    path = tmp_path / "logs" / f"checkpoint_{epoch}.pth.tar"
    assert path.is_file(), f"no checkpoint after epoch {epoch}"
    state = torch.load(path)  # as the example's resume does (weights_only by default)
    assert isinstance(state["preconditioner"], dict), "the checkpoint has no 'preconditioner'"
    return state["preconditioner"]


def test_cifar10_resnet_example_checkpoints_and_resumes(
    examples_env: dict[str, str], tmp_path: Path
) -> None:
    """Three launches, one epoch each, each resuming from the last one's checkpoint.

    2 ranks (checkpoint written by rank 0 alone under MEM-OPT) → 2 ranks
    (resumes at the same size) → 1 rank (resumes a 2-rank checkpoint).  The
    example finds the newest ``checkpoint_{epoch}`` in ``--log-dir`` itself.
    """
    module = "examples.torch_cifar10_resnet"
    steps = 0
    printed: list[float] = []
    for epoch, nproc in [(1, 2), (2, 2), (3, 1)]:
        output = _torchrun(examples_env, tmp_path, nproc, module, _cifar_args(tmp_path, epoch))
        trained = re.findall(r"Epoch +(\d+)/ *\d+", output)
        assert set(trained) == {str(epoch)}, f"epoch {epoch} on {nproc} ranks trained {trained}"
        printed += _printed_losses(output)
        steps += TRAIN_IMAGES // nproc // BATCH
        saved = _checkpoint(tmp_path, epoch)
        assert saved["steps"] == steps, "the preconditioner's steps were not carried over"
        # rank 0 alone saves: under MEM-OPT on 2 ranks it holds its own layers' factors
        # (kaisa keeps each factor on its owner only); on 1 rank, every layer's
        with_factors = [n for n, entry in saved["layers"].items() if {"A", "G"} <= set(entry)]
        assert with_factors, "the checkpoint holds no factors"
        assert nproc > 1 or len(with_factors) == RESNET20_LAYERS, with_factors
        hyper = saved["hyperparameters"]
        assert hyper["damping"] == pytest.approx(DAMPING / 2**epoch)
        assert (hyper["factor_update_steps"], hyper["inv_update_steps"]) == (2**epoch, 2 * 2**epoch)

    assert all(math.isfinite(v) for v in printed), printed
    scalars = [json.loads(line) for line in (tmp_path / "logs" / "scalars.jsonl").open()]
    losses = {(s["tag"], s["step"]): s["value"] for s in scalars if s["tag"].endswith("/loss")}
    assert set(losses) == {(t, e) for t in ("train/loss", "val/loss") for e in (1, 2, 3)}
    assert all(math.isfinite(v) for v in losses.values()), losses


# -- Transformer language model -------------------------------------------------------
@pytest.mark.parametrize(("nproc", "strategy"), [(1, "COMM_OPT"), (2, "HYBRID_OPT")])
def test_language_model_example(
    examples_env: dict[str, str], tmp_path: Path, nproc: int, strategy: str
) -> None:
    args = [
        "--kfac", "--backend", "gloo", "--no-cuda", "--strategy", strategy,
        "--dataset", "penntreebank", "--download-dir", str(tmp_path / "data"),
        "--epochs", "2", "--seq-len", "16", "--batch-size", "4",
        "--embedding-dim", "32", "--hidden-dim", "64", "--attention-heads", "2", "--layers", "1",
        "--factor-update-steps", "1", "--inv-update-steps", "2",
    ]  # fmt: skip
    output = _torchrun(examples_env, tmp_path, nproc, "examples.torch_language_model", args)
    assert "Preconditioner config:" in output
    assert "Training completed" in output and "Epoch  2/ 2" in output
    assert all(math.isfinite(v) for v in _printed_losses(output))
