"""Runs with a compiled model (``compile_model``): the same numbers as eager,
compiled in the untimed warm-up and never on a run's clock, each kind of run
on compiled code of its own, and records apart from the eager ones."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.replay import Replay
from kaisa_lab.cli import train as train_module
from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.main import main
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.cli.train import train_lockstep, warm_up
from kaisa_lab.tasks.registry import get_task

CPU = DistContext(device=torch.device("cpu"))
QUIET = Progress(enabled=False, bars=False)


@pytest.fixture(autouse=True)
def _dynamo_as_it_was() -> Iterator[None]:
    """A compiled run sets dynamo's process-wide guards and limits (what a
    lab process wants); the tests after these get them back as they were."""
    config = torch._dynamo.config
    saved = (config.skip_nnmodule_hook_guards, config.recompile_limit)
    yield
    config.skip_nnmodule_hook_guards, config.recompile_limit = saved
    torch._dynamo.reset()


def _specs(compile_model: str | None) -> list[RunSpec]:
    """K-FAC on SGD first, then SGD alone (were their compiled code shared, the
    plain run would run the K-FAC run's graphs), then K-FAC on SGD's last layer
    only (the same optimizer, graphs of its own)."""
    case = get_case("quick")
    base = case.spec(case.arms[1], case.grid(case.arms[1])[1], 0)
    kfac = {"loss_average": "batch", "factor_update_steps": 2, "inv_update_steps": 4}
    common = {"epochs": 1, "evals_per_epoch": 3, "stop_at_target": False}
    return [
        dataclasses.replace(base, kfac_kwargs=kfac, compile_model=compile_model, **common),
        dataclasses.replace(
            base, name="sgd", kfac=False, kfac_kwargs={}, compile_model=compile_model, **common
        ),
        dataclasses.replace(
            base,
            name="sgd+kfac-last",
            kfac_kwargs={**kfac, "skip_layers": ["0"]},
            compile_model=compile_model,
            **common,
        ),
    ]


def _curve(result: object) -> list[float]:
    """A run's evaluations, flat: step, training loss, metric for each."""
    curve = result.curve  # type: ignore[attr-defined]
    return [float(v) for r in curve for v in (r.step, r.train_loss, r.metric)]


def test_a_compiled_group_trains_as_the_eager_one_and_compiles_off_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = get_task("digits-mlp")
    data = task.load()
    eager = train_lockstep(_specs(None), task, data, CPU, QUIET)
    specs = _specs("aot_eager")
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]  # the process's count so far
    warm_up(specs, task, data, CPU)
    assert counters["stats"]["unique_graphs"] == before  # the throwaway warm-up runs eager
    # the graphs each run compiled before the rounds (its clock) started, and during them
    compiled: list[int] = []
    rounds = train_module._run_rounds

    def counted(*args: Any, **kwargs: Any) -> None:
        compiled.append(counters["stats"]["unique_graphs"])
        rounds(*args, **kwargs)
        compiled.append(counters["stats"]["unique_graphs"])

    monkeypatch.setattr(train_module, "_run_rounds", counted)
    results = train_lockstep(specs, task, data, CPU, QUIET)
    # each K-FAC run's factor and other step, the plain forward: all before the clock
    assert compiled[0] - before >= 5 and compiled[1] == compiled[0]
    for ours, theirs in zip(results, eager, strict=True):
        assert len(ours.curve) == 3 and ours.curve[-1].step == theirs.curve[-1].step
        assert _curve(ours) == pytest.approx(_curve(theirs), rel=1e-5, abs=1e-6)
    # K-FAC did its work under compile: its runs are not the plain one's
    assert _curve(results[0]) != pytest.approx(_curve(results[1]), rel=1e-3)
    assert _curve(results[2]) != pytest.approx(_curve(results[1]), rel=1e-3)


def test_a_compiled_run_has_a_key_of_its_own_and_an_eager_one_keeps_its_own() -> None:
    eager = _specs(None)[0]
    assert "compile_model" not in eager.to_dict()
    assert dataclasses.replace(eager, compile_model="inductor").to_dict()["compile_model"] == (
        "inductor"
    )


def test_a_replay_compiles_only_when_asked_and_its_records_are_apart(tmp_path: Path) -> None:
    from tests.lab.fake_campaign import fill

    source = fill(tmp_path / "source", "quick")
    case = get_case("quick")
    eager = Replay(case, RecordStore(tmp_path / "eager"), source)
    compiled = Replay(case, RecordStore(tmp_path / "compiled"), source, None, "inductor")
    (unit,) = eager.units()[:1]
    (twin,) = compiled.units()[:1]
    assert all(r.spec.compile_model is None for r in unit.runs)
    assert all(r.spec.compile_model == "inductor" for r in twin.runs)
    assert {r.key for r in unit.runs}.isdisjoint(r.key for r in twin.runs)


def test_compile_model_is_a_replays_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "status", "quick", "--records", str(tmp_path), "--compile-model"])
    assert "argument --compile-model: a replay's option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--task", "digits-mlp", "--compile-model", "tvm"])
    assert "--compile-model: invalid choice: 'tvm'" in capsys.readouterr().err


def test_a_compiled_replay_records_and_reports_its_runs_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.lab.fake_campaign import fill

    source = fill(tmp_path / "source", "quick")
    out = ["--records", str(tmp_path / "replay"), "--selected-from", str(source.store.root)]
    compiled = ["--compile-model", "aot_eager"]
    run = ["bench", "run", "quick", *out, "--arms", "sgd,sgd+kfac", "--no-wait"]
    assert main([*run, *compiled]) == 0
    records = [json.loads(p.read_text()) for p in (tmp_path / "replay").glob("quick/*/*.json")]
    assert len(records) == 2 * len(get_case("quick").protocol.heldout_seeds)
    assert all(r["config"]["compile_model"] == "aot_eager" for r in records)
    capsys.readouterr()
    assert main(["bench", "report", "quick", *out, *compiled]) == 0
    table = capsys.readouterr().out
    assert "| sgd |" in table and "| sgd + K-FAC (library defaults) |" in table
    # the eager replay of the same folder has none of them
    assert main(["bench", "report", "quick", *out]) == 0
    assert capsys.readouterr().out == "_No held-out records yet._\n"


def test_a_run_reading_a_fraction_of_the_positions_trains_compiled_as_eager(
    tmp_path: Path,
) -> None:
    """Position sampling under compile (each factor step's draw a graph
    input): a compiled run equals the eager one, and a replay of a levers case
    compiles its position-sampling arms like any other."""
    from tests.lab.fake_campaign import fill

    task = get_task("text-lm")  # sequences: positions to sample
    case = get_case("text-lm")
    arm = case.arm("muon+kfac")
    eager = dataclasses.replace(
        case.spec(arm, case.grid(arm)[0], 0),
        position_fraction=0.25,
        kfac_kwargs={"factor_update_steps": 2, "inv_update_steps": 4},
        epochs=1,
        steps_per_epoch=6,
        evals_per_epoch=2,
        stop_at_target=False,
    )
    data = task.load()
    (want,) = train_lockstep([eager], task, data, CPU, QUIET)
    compiled = dataclasses.replace(eager, compile_model="aot_eager")
    (got,) = train_lockstep([compiled], task, data, CPU, QUIET)
    assert _curve(got) == pytest.approx(_curve(want), rel=1e-5, abs=1e-6)
    case = get_case("text-lm-levers")
    source = fill(tmp_path / "source", case.name)
    replay = Replay(case, RecordStore(tmp_path / "replay"), source, None, "inductor")
    assert "muon+kfac-pos0.125" in {a.name for a in replay.replayed}
