"""The ``kaisa`` command, run in-process on tiny digits-mlp runs (a few seconds each)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch

from kaisa.config import KFACConfig
from kaisa_lab.cli.distributed import DistContext, eval_indices
from kaisa_lab.cli.main import build_parser, main
from kaisa_lab.cli.options import kfac_options, kfac_overrides
from kaisa_lab.tasks import get_task

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_FIELDS = {
    "name",
    "optimizer",
    "kfac",
    "task",
    "target",
    "metric_name",
    "higher_is_better",
    "time_to_target_s",
    "steps_to_target",
    "epochs_to_target",
    "final_metric",
    "wall_time_s",
    "config",
    "curve",
}
# One thread: these models are too small to gain from more, and a single thread
# keeps the tests fast when other processes compete for the cores.
#: the repository; its src/ (kaisa) and lab/src/ (kaisa_lab) are what a
#: command started by a test runs (as pytest's pythonpath does in-process)
ROOT = Path(__file__).resolve().parents[2]


def tree_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that runs this tree's kaisa and kaisa_lab,
    installed or not."""
    paths = [str(ROOT / "src"), str(ROOT / "lab" / "src"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)


QUICK = ["--task", "digits-mlp", "--max-steps-per-epoch", "5", "--quiet", "--threads", "1"]


def run_cli(out: Path, *args: str) -> list[dict[str, Any]]:
    """Run ``kaisa`` in-process and return the parsed results.json."""
    threads = torch.get_num_threads()
    try:
        assert main([*args, "--out", str(out)]) == 0
    finally:  # --threads is process-wide: do not leak it into other tests
        torch.set_num_threads(threads)
    runs: list[dict[str, Any]] = json.loads((out / "results.json").read_text())
    return runs


def assert_valid_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    # A target of 0.5 accuracy is reached within 10 steps by both runs.
    out = tmp_path_factory.mktemp("compare")
    return out, run_cli(out, "compare", *QUICK, "--epochs", "2", "--target", "0.5")


def test_compare_writes_both_runs_with_all_fields(
    compared: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, runs = compared
    assert [r["name"] for r in runs] == ["sgd", "sgd+kfac"]
    assert [r["kfac"] for r in runs] == [False, True]
    for run in runs:
        assert set(run) >= RUN_FIELDS
        assert run["task"] == "digits-mlp" and run["optimizer"] == "sgd"
        assert run["metric_name"] == "accuracy" and run["higher_is_better"] is True
        assert run["target"] == 0.5
        curve = run["curve"]
        assert [p["epoch"] for p in curve] == [1, 2]
        assert [p["step"] for p in curve] == [5, 10]
        assert 0 < curve[0]["wall_time_s"] < curve[1]["wall_time_s"] == run["wall_time_s"]
        assert 0 < curve[0]["cpu_time_s"] < curve[1]["cpu_time_s"]  # a CPU run: both clocks
        assert all(0.0 <= p["metric"] <= 1.0 and p["train_loss"] > 0 for p in curve)
        assert run["final_metric"] == curve[-1]["metric"]
        # Target reached: the first epoch at or above it is the one reported.
        first = next(p for p in curve if p["metric"] >= run["target"])
        assert run["steps_to_target"] == first["step"]
        assert run["epochs_to_target"] == first["epoch"]
        assert run["time_to_target_s"] == first["wall_time_s"]
    assert_valid_png(out / "results.png")


def test_one_seed_keeps_the_original_fields_and_table(
    compared: tuple[Path, list[dict[str, Any]]],
) -> None:
    """--seeds defaults to 1: the original fields are that seed's run; seeds/summary are extra."""
    _, runs = compared
    for run in runs:
        (seed,) = run["seeds"]
        assert seed["seed"] == run["config"]["seed"] == 0
        for key in ("time_to_target_s", "steps_to_target", "final_metric", "curve"):
            assert run[key] == seed[key]
        summary = run["summary"]
        assert summary["n_seeds"] == 1 and summary["reached"] == 1
        assert summary["time_to_target_s"]["median"] == run["time_to_target_s"]


def test_compare_runs_share_hyperparameters_and_record_kfac_config(
    compared: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, (sgd, kfac) = compared
    shared = ("batch_size", "momentum", "weight_decay", "seed", "epochs")
    assert {k: sgd["config"][k] for k in shared} == {k: kfac["config"][k] for k in shared}
    task = get_task("digits-mlp")  # each arm at its own lr: the suite's selection, else the prior
    assert (sgd["config"]["lr"], kfac["config"]["lr"]) == (
        task.arm(False, "sgd")[0],
        task.arm(True, "sgd")[0],
    )
    assert sgd["config"]["kfac"] is None
    kfac_config = kfac["config"]["kfac"]
    assert set(KFACConfig.field_names()) <= set(kfac_config)
    # no knobs selected for the arm: K-FAC at the library's defaults
    assert not get_task("digits-mlp").kfac_for("sgd")
    assert kfac_config["damping"] == KFACConfig().damping
    assert kfac_config["lr"] == kfac["config"]["lr"] and kfac_config["lr_from_optimizer"]
    assert kfac_config["loss_average"] == "batch"
    # Different optimizers from the same start: the first epochs differ.
    assert sgd["curve"][0]["train_loss"] != kfac["curve"][0]["train_loss"]


def test_compare_prints_a_table_saying_evaluation_is_excluded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = run_cli(tmp_path, "compare", *QUICK, "--epochs", "1", "--target", "1.01")
    text = capsys.readouterr().out
    assert "every evaluation is excluded (clock paused)" in text
    assert "sgd+kfac" in text and "[sgd] epoch 1/1" in text
    # one seed: the table of one run per row, not the seed table's medians over "seeds 0-N"
    assert "median" not in text and "seeds 0" not in text and "; seed 0" in text
    for run in runs:  # accuracy can never reach 1.01
        assert run["time_to_target_s"] is None
        assert run["steps_to_target"] is None and run["epochs_to_target"] is None


def test_wall_time_excludes_evaluation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake clock that jumps 1000 s during each evaluation must not show in the times."""
    import kaisa_lab.cli.train as train_module

    now = [0.0]

    def fake_clock() -> float:
        now[0] += 0.001
        return now[0]

    real_evaluate = train_module.evaluate

    def slow_evaluate(*args: Any, **kwargs: Any) -> dict[str, float]:
        now[0] += 1000.0
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module.time, "perf_counter", fake_clock)
    monkeypatch.setattr(train_module, "evaluate", slow_evaluate)
    (run,) = run_cli(tmp_path, "train", "--no-kfac", *QUICK, "--epochs", "3", "--target", "0.3")
    assert 0 < run["wall_time_s"] < 1.0
    assert run["time_to_target_s"] is not None and run["time_to_target_s"] < 1.0


def test_progress_bars_on_a_terminal_unless_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kaisa_lab.cli import progress

    args = ["train", "--no-kfac", "--task", "digits-mlp", "--max-steps-per-epoch", "3"]
    main([*args, "--epochs", "1", "--out", str(tmp_path)])  # captured: not a terminal
    redirected = capsys.readouterr().out
    assert "100%" not in redirected and "\r" not in redirected
    assert "[sgd] epoch 1/1 step 3 train_loss" in redirected  # a plain line per epoch
    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    main([*args, "--epochs", "1", "--out", str(tmp_path)])
    bars = capsys.readouterr().out
    assert "[sgd] epoch 1/1: 100%" in bars and "3/3" in bars and "loss=" in bars
    main([*args, "--epochs", "1", "--quiet", "--out", str(tmp_path)])
    quiet = capsys.readouterr().out
    assert "100%" not in quiet and "[sgd] epoch 1/1 step 3 train_loss" in quiet


def test_train_with_kfac_options(tmp_path: Path) -> None:
    (run,) = run_cli(
        tmp_path,
        "train",
        *QUICK,
        "--epochs",
        "1",
        "--kfac-damping",
        "0.05",
        "--kfac-kl-clip",
        "none",
        "--kfac-inv-update-steps",
        "2",
        "--kfac-skip-layers",
        "4",
        "--kfac-lr",
        "0.2",
    )
    assert run["kfac"] is True and run["name"] == "sgd+kfac" and len(run["curve"]) == 1
    config = run["config"]["kfac"]
    assert config["damping"] == 0.05 and config["kl_clip"] is None
    assert config["inv_update_steps"] == 2 and config["skip_layers"] == ["4"]
    assert config["lr"] == 0.2 and config["lr_from_optimizer"] is False
    assert_valid_png(tmp_path / "results.png")


def test_train_without_kfac_and_other_optimizer(tmp_path: Path) -> None:
    (run,) = run_cli(tmp_path, "train", "--no-kfac", *QUICK, "--epochs", "2", "--optimizer", "adam")
    assert run["kfac"] is False and run["name"] == "adam"
    assert run["config"]["lr"] == get_task("digits-mlp").defaults.lr["adam"]
    assert run["config"]["kfac"] is None
    assert len(run["curve"]) == 2


def _without_clocks(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A curve without its clocks' readings (the wall's and the CPU's): what a
    rerun of the same seed reproduces bit for bit."""
    return [{k: v for k, v in p.items() if k not in ("wall_time_s", "cpu_time_s")} for p in curve]


def test_same_seed_same_results_other_seed_other_results(tmp_path: Path) -> None:
    args = ("train", "--no-kfac", *QUICK, "--epochs", "1")
    a = run_cli(tmp_path / "a", *args, "--seed", "1")[0]["curve"]
    b = run_cli(tmp_path / "b", *args, "--seed", "1")[0]["curve"]
    c = run_cli(tmp_path / "c", *args, "--seed", "2")[0]["curve"]
    assert _without_clocks(a) == _without_clocks(b)
    assert a[0]["train_loss"] != c[0]["train_loss"]


def test_stop_at_target_ends_the_run_early(tmp_path: Path) -> None:
    (run,) = run_cli(
        tmp_path,
        "train",
        "--no-kfac",
        *QUICK,
        "--epochs",
        "5",
        "--target",
        "0.3",
        "--stop-at-target",
    )
    assert run["epochs_to_target"] is not None
    assert len(run["curve"]) == run["epochs_to_target"] < 5


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--kfac-damping", "-1"], "--kfac-damping"),
        (["--kfac-damping", "abc"], "--kfac-damping"),
        (["--kfac-grad-worker-fraction", "most"], "--kfac-grad-worker-fraction"),
        (["--kfac-grad-worker-fraction", "1.5"], "--kfac-grad-worker-fraction"),
        (["--kfac-factor-update-steps", "1.5"], "--kfac-factor-update-steps"),
        (["--kfac-compute-method", "cholesky"], "--kfac-compute-method"),
        (["--kfac-symmetry-aware", "maybe"], "--kfac-symmetry-aware"),
        (["--kfac-inv-dtype", "float16"], "--kfac-inv-dtype"),
        (["--optimizer", "rmsprop"], "--optimizer"),
        (["--epochs", "0"], "--epochs"),
        (["--evals-per-epoch", "0"], "--evals-per-epoch"),
        (["--lr", "-0.1"], "--lr"),
        (["--task", "mnist"], "--task"),
        (["--schedule", "linear"], "--schedule"),
        (["--warmup-epochs", "-1"], "--warmup-epochs"),
        (["--warmup-epochs", "nan"], "--warmup-epochs"),
        (["--warmup-epochs", "3", "--epochs", "2"], "--warmup-epochs"),
        (["--kfac-arm-lr", "0"], "--kfac-arm-lr"),
        (["--kfac-arm-lr", "inf"], "--kfac-arm-lr"),
        (["--lr", "inf"], "--lr"),
        (["--target", "nan"], "--target"),
        (["--kfac-arm-schedule", "linear"], "--kfac-arm-schedule"),
        (["--kfac-arm-warmup-epochs", "-1"], "--kfac-arm-warmup-epochs"),
        (["--kfac-arm-warmup-epochs", "3", "--epochs", "2"], "--kfac-arm-warmup-epochs"),
    ],
)
def test_bad_option_values_exit_2_naming_the_option(
    args: list[str], option: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", *args, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("command", ["train", "plan"])
def test_an_output_folder_that_is_a_file_is_refused_before_anything_runs(
    command: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Checked when the command line is read: a run used to train to its end
    and then fail to write its results."""
    taken = tmp_path / "results"
    taken.write_text("a file")
    for out in (taken, taken / "sub"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--task", "digits-mlp", "--out", str(out)])
        assert exc.value.code == 2
        assert "argument --out" in capsys.readouterr().err


def test_missing_cifar_data_is_a_clear_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--task", "cifar10", "--data-dir", str(tmp_path), "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and "data_batch_1" in err


def test_a_garbled_cifar_file_is_a_clear_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kaisa_lab.tasks.cifar import SUBFOLDER

    from fakes import write_fake_cifar

    write_fake_cifar(tmp_path / SUBFOLDER)
    (tmp_path / SUBFOLDER / "data_batch_2").write_bytes(b"not a pickle")
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "train",
                "--task",
                "cifar10",
                "--data-dir",
                str(tmp_path),
                "--out",
                str(tmp_path / "o"),
            ]
        )
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --data-dir" in err and "data_batch_2" in err


def test_every_kfac_config_field_has_a_typed_option() -> None:
    parser, commands = build_parser()
    help_text = commands["train"].format_help()
    for option in kfac_options():
        assert option.flag in help_text
    assert [o.field for o in kfac_options()] == list(KFACConfig.field_names())
    args = parser.parse_args(
        [
            "compare",
            "--kfac-factor-update-steps",
            "3",
            "--kfac-factor-decay",
            "0.9",
            "--kfac-grad-worker-fraction",
            "HYBRID_OPT",
            "--kfac-colocate-factors",
            "false",
            "--kfac-skip-layers",
            "fc.*",
            "conv1",
            "--kfac-factor-dtype",
            "float64",
            "--kfac-kl-clip",
            "None",
        ]
    )
    overrides = kfac_overrides(args)
    assert overrides == {
        "factor_update_steps": 3,
        "factor_decay": 0.9,
        "grad_worker_fraction": "hybrid-opt",
        "colocate_factors": False,
        "skip_layers": ("fc.*", "conv1"),
        "factor_dtype": "float64",
        "kl_clip": None,
    }
    assert type(overrides["factor_update_steps"]) is int
    KFACConfig.from_options(**overrides)
    assert kfac_overrides(parser.parse_args(["train"])) == {}
    fraction = parser.parse_args(["train", "--kfac-grad-worker-fraction", "0.25"])
    assert kfac_overrides(fraction) == {"grad_worker_fraction": 0.25}


def test_single_process_context_and_eval_shards() -> None:
    single = DistContext(device=torch.device("cpu"))
    assert single.is_main and not single.is_distributed
    values = torch.tensor([1.0, 2.0])
    assert torch.equal(single.sum(values), values)
    shards = [
        eval_indices(10, DistContext(torch.device("cpu"), rank=r, world_size=3)) for r in range(3)
    ]
    assert sorted(torch.cat(shards).tolist()) == list(range(10))


@pytest.mark.parametrize("module", ["kaisa", "kaisa_lab"])
def test_python_dash_m_kaisa_help(module: str) -> None:
    """``python -m kaisa`` (the library's hand-over) and ``python -m kaisa_lab``."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        env=tree_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: kaisa" in proc.stdout
    assert "train" in proc.stdout and "compare" in proc.stdout


def test_the_kaisa_console_script_is_kaisa_labs() -> None:
    """The installed ``kaisa`` command runs kaisa-lab's main (kaisa itself
    declares no script); skipped where kaisa-lab is not installed in this
    interpreter's environment (in-tree egg-info on the path does not count)."""
    site = [sysconfig.get_paths()["purelib"]]
    found = list(importlib.metadata.distributions(name="kaisa-lab", path=site))
    if not found:
        pytest.skip("kaisa-lab is not installed here (pip install -e ./lab)")
    (lab,) = found
    (script,) = [e for e in lab.entry_points if e.group == "console_scripts"]
    assert (script.name, script.value) == ("kaisa", "kaisa_lab.cli.main:main")
    (library,) = importlib.metadata.distributions(name="kaisa", path=site)
    assert [e for e in library.entry_points if e.group == "console_scripts"] == []
    command = Path(sys.executable).parent / "kaisa"
    proc = subprocess.run(
        [str(command), "plan", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: kaisa plan" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", *QUICK, "--device", "cuda", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "argument --device" in capsys.readouterr().err


def _record_lrs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, float | None]]:
    """Patch the training step to record (run, optimizer lr, K-FAC's lr) at every step."""
    from kaisa_lab.cli import trainer

    seen: list[tuple[str, float, float | None]] = []
    original = trainer.Trainer.step

    def step(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        precond = self.preconditioner
        lr = self.optimizer.param_groups[0]["lr"]
        seen.append(("kfac" if precond else "sgd", lr, None if precond is None else precond.lr))
        return original(self, x, y)

    monkeypatch.setattr(trainer.Trainer, "step", step)
    return seen


def test_cosine_schedule_sets_the_lr_of_both_runs_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 epochs x 5 steps, 1 warm-up epoch: lr = base (s+1)/5, then cosine to 0 over 10 steps."""
    seen = _record_lrs(monkeypatch)
    base = 0.1  # given: the arms' own (selected) lrs are another test's subject
    sgd, kfac = run_cli(
        tmp_path, "compare", *QUICK, "--epochs", "3", "--schedule", "cosine", "--warmup-epochs",
        "1", "--lr", str(base),
    )  # fmt: skip
    expected = [base * (s + 1) / 5 for s in range(5)]
    expected += [base * 0.5 * (1 + math.cos(math.pi * (s - 5) / 10)) for s in range(5, 15)]
    # The first steps of each kind are compare's untimed warm-up at the base lr.
    for name in ("sgd", "kfac"):
        lrs = [lr for run, lr, _ in seen if run == name][-15:]
        assert lrs == pytest.approx(expected, rel=1e-12)
    # K-FAC reads the scheduled lr from the optimizer (its KL clip follows it).
    kfac_steps = [(lr, precond_lr) for run, lr, precond_lr in seen if run == "kfac"][-15:]
    assert all(lr == precond_lr for lr, precond_lr in kfac_steps)
    for run in (sgd, kfac):
        assert run["config"]["schedule"] == "cosine" and run["config"]["warmup_epochs"] == 1.0
        assert run["config"]["lr"] == base


def test_the_kfac_arm_takes_its_own_lr_and_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kfac-arm-*: SGD warms up for 5 steps then decays; K-FAC starts at its own lr."""
    seen = _record_lrs(monkeypatch)
    base = 0.1
    sgd, kfac = run_cli(
        tmp_path, "compare", *QUICK, "--epochs", "3", "--schedule", "cosine", "--lr", str(base),
        "--warmup-epochs", "1", "--kfac-arm-warmup-epochs", "0", "--kfac-arm-lr", "0.05",
    )  # fmt: skip
    warm = [base * (s + 1) / 5 for s in range(5)]
    warm += [base * 0.5 * (1 + math.cos(math.pi * (s - 5) / 10)) for s in range(5, 15)]
    cold = [0.05 * 0.5 * (1 + math.cos(math.pi * s / 15)) for s in range(15)]
    assert [lr for run, lr, _ in seen if run == "sgd"][-15:] == pytest.approx(warm, rel=1e-12)
    kfac_steps = [(lr, precond_lr) for run, lr, precond_lr in seen if run == "kfac"][-15:]
    assert [lr for lr, _ in kfac_steps] == pytest.approx(cold, rel=1e-12)
    assert all(lr == precond_lr for lr, precond_lr in kfac_steps)  # the KL clip follows
    assert (sgd["config"]["lr"], sgd["config"]["warmup_epochs"]) == (base, 1.0)
    assert (kfac["config"]["lr"], kfac["config"]["warmup_epochs"]) == (0.05, 0.0)
    assert kfac["config"]["kfac"]["lr"] == 0.05 and kfac["config"]["schedule"] == "cosine"


def _select(monkeypatch: pytest.MonkeyPatch, task: str, **arms: Any) -> None:
    """Make ``arms`` (name -> Selection) the suite's selections for ``task``."""
    from kaisa_lab.tasks import tuned

    monkeypatch.setattr(tuned, "load", lambda path=None: {task: dict(arms)})


def test_the_suites_selection_yields_to_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each arm's lr, schedule, warm-up and K-FAC knobs: the command line, then the
    suite's selection for that arm, then the task's prior; an arm without a
    selection is not tuned."""
    from kaisa_lab.cli.spec import build_specs
    from kaisa_lab.tasks.tuned import Selection

    task = get_task("digits-mlp")
    _select(
        monkeypatch,
        "digits-mlp",
        sgd=Selection(0.05, 0.5, "cosine"),
        **{"sgd+kfac": Selection(0.02, 0.0, "cosine", {"damping": 0.1})},
    )

    def specs(*argv: str) -> list[Any]:
        args = build_parser()[0].parse_args(["compare", *argv])
        return build_specs(args, task, [False, True])

    sgd, kfac = specs()
    assert (sgd.lr, sgd.schedule, sgd.warmup_epochs) == (0.05, "cosine", 0.5)
    assert (kfac.lr, kfac.schedule, kfac.warmup_epochs) == (0.02, "cosine", 0.0)
    assert kfac.kfac_kwargs["damping"] == 0.1 and sgd.lr_tuned and kfac.lr_tuned
    assert [s.lr for s in specs("--lr", "0.3")] == [0.3, 0.3]
    assert [s.lr for s in specs("--kfac-arm-lr", "0.04")] == [0.05, 0.04]
    assert [s.warmup_epochs for s in specs("--kfac-arm-warmup-epochs", "1")] == [0.5, 1.0]
    assert specs("--kfac-damping", "0.5")[1].kfac_kwargs["damping"] == 0.5
    adam, adam_kfac = specs("--optimizer", "adam")  # nothing selected for adam: the prior
    prior = task.defaults
    assert (adam.lr, adam.schedule, adam.warmup_epochs) == (
        prior.lr["adam"],
        prior.schedule,
        prior.warmup_epochs,
    )
    assert adam_kfac.lr == prior.lr["adam"] and not adam.lr_tuned and not adam_kfac.lr_tuned
    assert dict(adam_kfac.kfac_kwargs) == {"loss_average": task.loss_average}


def test_an_untuned_arm_is_named_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kaisa_lab.tasks.tuned import Selection

    _select(monkeypatch, "digits-mlp", sgd=Selection(0.1, 0.0, "constant"))
    run_cli(tmp_path, "compare", *QUICK, "--epochs", "1")
    err = capsys.readouterr().err
    assert "note: sgd+kfac runs at lr 0.1, not tuned for digits-mlp" in err
    assert "note: sgd runs" not in err


def test_constant_schedule_never_writes_the_lr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (constant, no warm-up) is bit-identical to training without a schedule."""
    from kaisa_lab.cli import trainer

    def refuse(self: Any, lr: float) -> None:
        raise AssertionError("a constant schedule must not write the lr")

    seen = _record_lrs(monkeypatch)
    monkeypatch.setattr(trainer.Trainer, "set_lr", refuse)
    base = 0.1
    # digits-mlp's schedule is constant; no warm-up given: the lr is never written
    args = ("train", *QUICK, "--epochs", "2", "--lr", str(base), "--warmup-epochs", "0")
    (default,) = run_cli(tmp_path / "a", *args)
    (explicit,) = run_cli(tmp_path / "b", *args, "--schedule", "constant")
    assert {lr for _, lr, _ in seen} == {base}
    assert default["config"]["schedule"] == "constant" and default["config"]["warmup_epochs"] == 0
    assert _without_clocks(default["curve"]) == _without_clocks(explicit["curve"])


def test_constant_schedule_with_warmup_ramps_then_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _record_lrs(monkeypatch)
    base = 0.1
    run_cli(
        tmp_path, "train", "--no-kfac", *QUICK, "--epochs", "2", "--warmup-epochs", "0.8",
        "--lr", str(base),
    )  # fmt: skip
    lrs = [lr for _, lr, _ in seen][-10:]
    assert lrs == pytest.approx([base * (s + 1) / 4 for s in range(4)] + [base] * 6, rel=1e-12)


def test_eval_steps_are_evenly_spaced_and_end_the_epoch() -> None:
    from kaisa_lab.cli.train import eval_steps

    assert eval_steps(23, 1) == {23}
    assert eval_steps(23, 4) == {6, 12, 18, 23}
    assert eval_steps(8, 4) == {2, 4, 6, 8}
    assert eval_steps(3, 10) == {1, 2, 3}


def test_evals_per_epoch_reads_the_metric_within_epochs_without_changing_training(
    tmp_path: Path,
) -> None:
    """Evaluating 4 times an epoch gives 4 points per epoch, and the same training.

    The K-FAC arm checks that evaluation forwards (model.eval(), no_grad) are
    not captured into the factors: the final metric must not move.
    """
    common = ["compare", *QUICK[:2], "--max-steps-per-epoch", "8", "--quiet", "--threads", "1"]
    once = run_cli(tmp_path / "once", *common, "--epochs", "2")
    fine = run_cli(tmp_path / "fine", *common, "--epochs", "2", "--evals-per-epoch", "4")
    for coarse, run in zip(once, fine, strict=True):
        assert run["config"]["evals_per_epoch"] == 4
        assert [p["step"] for p in run["curve"]] == [2, 4, 6, 8, 10, 12, 14, 16]
        assert [p["epoch"] for p in run["curve"]] == [0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2]
        times = [p["wall_time_s"] for p in run["curve"]]
        assert times == sorted(times) and times[0] > 0
        assert run["final_metric"] == coarse["final_metric"]
        # The points at epoch ends are the coarse run's points.
        assert [run["curve"][i]["metric"] for i in (3, 7)] == [p["metric"] for p in coarse["curve"]]


def test_stop_at_target_within_an_epoch(tmp_path: Path) -> None:
    (run,) = run_cli(
        tmp_path,
        "train",
        "--no-kfac",
        *QUICK,
        "--epochs",
        "3",
        "--evals-per-epoch",
        "5",
        "--target",
        "0.3",
        "--stop-at-target",
    )
    assert run["steps_to_target"] is not None and run["steps_to_target"] < 15
    assert run["curve"][-1]["step"] == run["steps_to_target"]
    assert run["epochs_to_target"] == pytest.approx(run["steps_to_target"] / 5)
