"""``kaisa plan`` says what it planned with, and each failure names its option (issue 21)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

import kaisa_lab.cli.plan as plan_cli
from kaisa.config import KFACConfig
from kaisa.core.workspace import MIN_BYTES, workspace_bytes
from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import layer_costs
from kaisa_lab.cli.main import main

MODULE = "plan_models_cli"
#: a hidden layer of 256 × 257 float32 (263 KB ≥ the workspace's 128 KiB) and a small head
SOURCE = (
    "import torch\nfrom torch import nn\n"
    "def big():\n"
    "    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2)), "
    "(torch.randn(1, 256),)\n"
)


@pytest.fixture
def plan_args(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield ["plan", "--model", f"{MODULE}:big", "--out", str(tmp_path / "out")]
    sys.modules.pop(MODULE, None)


def comm_opt_memory(out: Path, world: int) -> int:
    report = json.loads((out / "plan.json").read_text())
    return next(
        p["memory_max_bytes"]
        for p in report["plans"]
        if p["world_size"] == world and p["grad_worker_fraction"] == 1.0
    )


def test_header_names_the_intervals_and_method_the_table_used(
    plan_args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Unset, the intervals are the library's (10 and 100), not 1 and 1."""
    assert main([*plan_args, "--world-size", "2"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    defaults = KFACConfig()
    expected = {
        "factor_update_steps": defaults.factor_update_steps,
        "inv_update_steps": defaults.inv_update_steps,
        "compute_method": defaults.compute_method.value,
    }
    assert expected["factor_update_steps"] != 1 and expected["inv_update_steps"] != 1
    assert str(expected) in header
    out = Path(plan_args[-1])
    assert json.loads((out / "plan.json").read_text())["settings"] == expected
    given = ["--kfac-factor-update-steps", "3", "--kfac-compute-method", "eigen"]
    assert main([*plan_args, "--world-size", "2", *given]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "'factor_update_steps': 3, 'inv_update_steps': 100, 'compute_method': 'eigen'" in header


def test_save_costs_creates_its_folder(
    plan_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "not" / "yet" / "costs.json"
    assert main([*plan_args, "--world-size", "1", "--save-costs", str(target)]) == 0
    assert CostModel.load(target) == CostModel()


def test_each_failure_names_its_own_option(
    plan_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = {
        "--save-costs": ["--save-costs", str(blocker / "costs.json")],
        "--costs": ["--costs", str(tmp_path / "missing.json")],
        "--ranks-per-node": ["--ranks-per-node", "4"],  # without the intra-node bandwidth
        "--device": ["--measure-costs", "cpu", "--device", "cuda"],
        "--batch-size": ["--batch-size", "0"],  # it planned at the task's batch
        "--memory-budget-mib": ["--memory-budget-mib", "-1"],  # nothing fits, all "recommended"
    }
    for option, extra in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main([*plan_args, "--world-size", "1", *extra])
        assert exit_info.value.code == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        named = message.split(": ")[2]  # "kaisa plan: error: argument OPTIONS: why"
        assert option in named, message
        others = set(cases) - {option} - ({"--costs"} if option == "--save-costs" else set())
        assert not any(f"{o}/" in named or named.endswith(o) for o in others), message


FACTORIES = (
    "import torch\nfrom torch import nn\n"
    "def sized(width):\n    return nn.Linear(width, width)\n"
    "NUMBER = 3.0\n"
    "def text():\n    return 'a model'\n"
    "def triple():\n    return nn.Linear(2, 2), (torch.randn(1, 2),), 0\n"
    "def bare():\n    return nn.Sequential(nn.ReLU())\n"
    "def one_tensor():\n    return nn.Linear(4, 2), torch.randn(1, 4)\n"
    "def in_a_tuple():\n    return nn.Linear(4, 2), (torch.randn(1, 4),)\n"
)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("sized", "called with no arguments, but missing a required argument: 'width'"),
        ("NUMBER", "is a float, not a callable"),
        ("text", "returned a str; expected an nn.Module or (model, example inputs"),
        ("triple", "returned a tuple; expected an nn.Module or (model, example inputs"),
        ("bare", "the model has no layer K-FAC can precondition"),
    ],
)
def test_a_model_that_cannot_be_planned_is_a_usage_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    name: str,
    why: str,
) -> None:
    (tmp_path / "plan_factories_cli.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plan_factories_cli", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", f"plan_factories_cli:{name}", "--world-size", "1"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --model" in message and why in message, message


def test_an_example_given_as_one_tensor_is_one_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``(model, x)`` with ``x`` a tensor is the input ``x``, not ``tuple(x)``'s rows."""
    (tmp_path / "plan_factories_cli.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plan_factories_cli", raising=False)
    reports = []
    for name in ("one_tensor", "in_a_tuple"):
        out = tmp_path / name
        argv = ["plan", "--model", f"plan_factories_cli:{name}", "--world-size", "1"]
        assert main([*argv, "--batch-size", "8", "--out", str(out)]) == 0
        reports.append(json.loads((out / "plan.json").read_text()))
    assert reports[0]["plans"] and reports[0] == reports[1]  # the same rows: 8 per step


def test_the_old_zoo_name_points_to_kaisa_lab(capsys: pytest.CaptureFixture[str]) -> None:
    """``--model kaisa.zoo:resnet50`` (the docs' spelling before kaisa-lab)
    names the new one instead of "No module named 'kaisa.zoo'"."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "kaisa.zoo:resnet50", "--world-size", "1"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --model" in message and "--model kaisa_lab.zoo:resnet50" in message, message


def test_a_gpu_plan_leaves_out_the_cpu_workspace(
    plan_args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The workspace is CPU-only (kaisa.core.workspace): --device cuda, or costs
    measured on cuda, must not count it; a CPU plan does."""
    out = Path(plan_args[-1])
    big = 256 * 257
    assert big * 4 >= MIN_BYTES
    held = workspace_bytes(big, 4, 4)
    assert main([*plan_args, "--world-size", "2"]) == 0
    cpu = comm_opt_memory(out, 2)
    assert main([*plan_args, "--world-size", "2", "--device", "cuda"]) == 0
    assert cpu - comm_opt_memory(out, 2) == held
    assert "layers on cuda" in capsys.readouterr().out
    monkeypatch.setattr(plan_cli, "measure_costs", lambda device: CostModel(device=device))
    assert main([*plan_args, "--world-size", "2", "--measure-costs", "cuda"]) == 0
    assert cpu - comm_opt_memory(out, 2) == held
    assert main([*plan_args, "--world-size", "2", "--measure-costs", "cpu"]) == 0
    assert comm_opt_memory(out, 2) == cpu


def test_layer_costs_on_another_device() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    assert [la.reuses_workspace for la in layer_costs(model)] == [True, False]
    assert [la.reuses_workspace for la in layer_costs(model, device="cuda")] == [False, False]
    assert [la.reuses_workspace for la in layer_costs(model, device="cpu")] == [True, False]


def test_plan_writes_files_only_when_given_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--task", "digits-mlp", "--world-size", "1", "2"]) == 0
    assert list(tmp_path.iterdir()) == []  # printed only
    assert "wrote" not in capsys.readouterr().out
    assert main(["plan", "--task", "digits-mlp", "--world-size", "2", "--out", "here"]) == 0
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["plan.json", "plan.png"]


def test_every_option_of_every_command_has_help() -> None:
    import argparse

    from kaisa_lab.cli.main import build_parser

    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")
            elif action.option_strings and action.dest != "help" and not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings)}")

    walk(build_parser()[0], "kaisa")
    assert not missing


def test_memory_is_given_in_mib_on_every_command() -> None:
    from kaisa_lab.cli.main import build_parser

    parser, commands = build_parser()
    flags = {
        flag
        for sub in ("train", "compare", "plan")
        for action in commands[sub]._actions
        for flag in action.option_strings
        if "memory" in flag and "budget" in flag
    }
    assert flags == {"--kfac-memory-budget-mib", "--memory-budget-mib"}
    args = parser.parse_args(["train", "--kfac-memory-budget-mib", "64"])
    assert args.kfac_memory_budget_mb == 64.0  # the option counts MiB
