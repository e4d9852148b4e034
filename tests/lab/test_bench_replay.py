"""A replay: a case's held-out seeds run again, on another machine or device,
at the settings another record folder's campaign selected (``kaisa bench run
CASE --selected-from DIR``), recorded in a folder of its own and reported like
any case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.lab.fake_campaign import fill

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.replay import Replay
from kaisa_lab.cli.main import main

CASE = get_case("quick")
ARMS = ["sgd", "sgd+kfac"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    """Every arm of the quick case selected (records written without training)."""
    return fill(tmp_path_factory.mktemp("source"), "quick")


def test_a_replay_runs_the_held_out_seeds_at_the_sources_selections(
    source: Campaign, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--records", str(tmp_path), "--selected-from", str(source.store.root)]
    assert main(["bench", "run", "quick", *out, "--arms", ",".join(ARMS), "--no-wait"]) == 0
    status = capsys.readouterr().out
    assert "sgd+kfac tuned" in status and "skipped" in status
    records = [json.loads(p.read_text()) for p in tmp_path.glob("quick/*/*.json")]
    held = CASE.protocol.heldout_seeds
    assert sorted((r["arm"], r["seed"]) for r in records) == sorted(
        (a, s) for a in ARMS for s in held
    )
    for record in records:
        arm = next(a for a in CASE.arms if a.name == record["arm"])
        picked = source.state(arm).selected
        assert picked is not None and record["role"] == "heldout"
        assert record["config"]["lr"] == picked.lr
        assert record["config"]["warmup_epochs"] == picked.warmup_epochs
    # the arms of a seed stepped in one lockstep group
    for seed in held:
        assert len({r["group"] for r in records if r["seed"] == seed}) == 1
    replay = Replay(CASE, RecordStore(tmp_path), source, ARMS)
    assert replay.units() == [] and sum(replay.runs_left(replay.state(a)) for a in CASE.arms) == 0
    # reported like any case: the arms whose runs are recorded, at the source's
    # settings (the tuned K-FAC arm too where it selected what the defaults
    # arm did: the two share those runs, as in any campaign)
    assert main(["bench", "report", "quick", *out]) == 0
    table = capsys.readouterr().out
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines()[2:]}
    picked = {a.name: source.state(a).selected for a in CASE.arms}
    shared = picked["sgd+kfac tuned"] == picked["sgd+kfac"]
    assert len(rows) == len(ARMS) + shared
    for name, label in (("sgd", "sgd"), ("sgd+kfac", "sgd + K-FAC (library defaults)")):
        assert f" {picked[name].describe()} " in rows[label]


def test_a_replay_before_it_runs_names_what_is_left(source: Campaign, tmp_path: Path) -> None:
    replay = Replay(CASE, RecordStore(tmp_path), source)
    assert replay.replayed == CASE.arms  # every arm selected in the source
    held = len(CASE.protocol.heldout_seeds)
    assert [replay.runs_left(replay.state(a)) for a in CASE.arms] == [held] * len(CASE.arms)
    # one run per arm, but a run two arms share (the same kind and setting) once
    runs = {(a.kind, replay.run(a, replay.state(a).selected, 0, "").key) for a in CASE.arms}
    assert [len(u.runs) for u in replay.units()] == [len(runs)] * held
    assert {u.stage for u in replay.units()} == {"heldout"}
    # an arm left out of a replay has nothing left to run
    two = Replay(CASE, RecordStore(tmp_path), source, ARMS)
    assert [two.runs_left(two.state(a)) for a in CASE.arms] == [held, held, 0]
    assert two.state(CASE.arms[2]).stage == "skipped"


def test_an_arm_without_a_selection_is_refused(tmp_path: Path) -> None:
    partial = fill(tmp_path / "partial", "quick", rounds=1)
    with pytest.raises(ValueError, match=r"arms: no selection yet .* sgd \(followup\)"):
        Replay(CASE, RecordStore(tmp_path / "out"), partial, ["sgd"])
    # without naming arms, a replay takes the selected ones: none here
    assert Replay(CASE, RecordStore(tmp_path / "out"), partial).units() == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--arms", "adam"], "argument --arms: unknown arm(s) adam"),
        (["--arms", "sgd", "--same"], "argument --selected-from: a replay records into"),
        (["--table", "tuning", "--report"], "argument --table: a replay runs no tuning"),
    ],
)
def test_bad_replay_arguments_name_the_argument(
    source: Campaign,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    command = "report" if "--report" in extra else "run"
    records = source.store.root if "--same" in extra else tmp_path
    argv = ["bench", command, "quick", "--records", str(records)]
    argv += ["--selected-from", str(source.store.root)]
    argv += [e for e in extra if e not in ("--same", "--report")]
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_arms_without_a_source_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "run", "quick", "--records", str(tmp_path), "--arms", "sgd"])
    assert "argument --arms: it names the arms of a replay" in capsys.readouterr().err
