"""The bar against the best tuned peer (``kaisa bench summary --goals``): each
claim read from records a test writes, met or missed by the ratio it names,
and not read at all while a case is still being measured."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from tests.lab.fake_campaign import fill, lr_bowl

from kaisa_lab.bench.campaign import Campaign, Run
from kaisa_lab.bench.goals import (
    Check,
    defaults_check,
    forecast_checks,
    markdown_goals,
    step_cost_checks,
    steps_check,
    time_check,
)
from kaisa_lab.bench.records import RecordStore

#: Muon needs half the steps of every other optimizer (the best peer); K-FAC
#: at the defaults 0.8× its base's steps, tuned 0.7×, at a step 1.25× as long
#: on AdamW and 1.1× on Muon
KFAC_STEPS = {False: 0.8, True: 0.7}
KFAC_STEP_S = {"adamw": 0.0125, "muon": 0.011}


def _steps(campaign: Campaign, run: Run) -> int:
    steps = lr_bowl(campaign, run) * (0.5 if run.arm.optimizer == "muon" else 1.0)
    return int(steps * (KFAC_STEPS[bool(run.arm.knobs)] if run.arm.kfac else 1.0))


def _step_s(run: Run) -> float:
    return KFAC_STEP_S.get(run.arm.optimizer, 0.01) if run.arm.kfac else 0.01


@pytest.fixture(scope="module")
def text_lm(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    return fill(tmp_path_factory.mktemp("goals") / "records", "text-lm", _steps, _step_s)


def test_the_time_check_pairs_the_fastest_kfac_arm_with_the_fastest_peer(
    text_lm: Campaign,
) -> None:
    check = time_check(text_lm, limit=0.85)
    assert check.compared == "muon + K-FAC (tuned) / muon"
    assert check.ratio == pytest.approx(0.7 * 1.1)
    assert check.verdict == "met"
    assert check.why == (
        "steps 0.70× (0.70× between evaluations), time a step 1.10×, time 0.77× between evaluations"
    )
    assert time_check(text_lm, limit=0.75).verdict == "missed"


def test_the_steps_check_reads_steps_not_time(text_lm: Campaign) -> None:
    check = steps_check(text_lm, limit=0.7)
    assert check.ratio == pytest.approx(0.7) and check.verdict == "met"
    assert check.why == "steps 0.70× (0.70× between evaluations)"
    assert steps_check(text_lm, limit=0.65).verdict == "missed"


def test_the_defaults_check_is_adamw_with_kfac_at_the_defaults_against_adamw(
    text_lm: Campaign,
) -> None:
    check = defaults_check(text_lm, limit=0.75)
    assert check.compared == "adamw + K-FAC (library defaults) / adamw"
    # 0.8× the steps at 1.25× the step: the same time, and the figures say why
    assert check.ratio == pytest.approx(1.0)
    assert check.verdict == "missed"
    assert check.why == (
        "steps 0.80× (0.80× between evaluations), time a step 1.25×, time 1.00× between evaluations"
    )


def test_a_case_still_being_measured_is_not_read(text_lm: Campaign) -> None:
    # one held-out record of one arm missing: no check reads the case
    record = next(p for p in (text_lm.store.root / "text-lm" / "muon").glob("*-s5.json"))
    saved = record.read_bytes()
    record.unlink()
    try:
        unfinished = Campaign(text_lm.case, RecordStore(text_lm.store.root))
        for check in (time_check(unfinished), steps_check(unfinished), defaults_check(unfinished)):
            assert check.ratio is None and check.verdict == "not measured yet"
            assert "not measured yet" in markdown_goals([check])
    finally:
        record.write_bytes(saved)


def _forecast(arm: str, steps: float, rank_ms: dict[str, float]) -> dict[str, Any]:
    layouts = {
        layout: {"step_ms": ms, "comm_ms": {"ddp": 0.0}, "forecast_s": steps * ms / 1e3}
        for layout, ms in rank_ms.items()
    }
    return {
        "config": {"arm": arm, "batch": 512, "world": 64},
        "result": {"measured": True, "steps": steps, "layouts": layouts},
    }


def test_the_forecast_check_is_read_per_layout() -> None:
    records = [
        _forecast("adamw", 160, {"replicated": 10.0, "sharded": 10.0}),
        _forecast("muon", 60, {"replicated": 12.0, "sharded": 10.0}),
        _forecast("muon+kfac", 45, {"replicated": 16.0, "sharded": 10.0}),
        _forecast("adamw+kfac", 100, {"replicated": 13.0, "sharded": 13.0}),
    ]
    replicated, sharded = forecast_checks(records, limit=0.8)
    # replicated: 45 × 16 = 720 against Muon's 60 × 12 = 720
    assert replicated.compared == "muon+kfac / muon" and replicated.ratio == pytest.approx(1.0)
    assert replicated.verdict == "missed"
    assert replicated.why == "steps 0.75×, a rank's step 1.33×"
    # sharded: 450 against 600
    assert sharded.ratio == pytest.approx(0.75) and sharded.verdict == "met"
    records[1]["result"]["measured"] = False
    assert [c.verdict for c in forecast_checks(records)] == ["not forecast yet"] * 2
    assert [c.verdict for c in forecast_checks(records[:2], world=16)] == ["not forecast yet"] * 2


def _timed(task: str, arm: str, cpu_ms: float) -> dict[str, Any]:
    return {"config": {"task": task, "arm": arm}, "result": {"cpu_ms": cpu_ms}}


def test_the_step_cost_check_is_the_cheapest_kfac_arm_against_muon_per_task() -> None:
    records = [
        _timed("text-lm", "muon", 100.0),
        _timed("text-lm", "muon+kfac", 117.0),
        _timed("text-lm", "muon+kfac-lean", 99.0),
        _timed("text-lm", "adamw", 80.0),  # not a K-FAC arm: not read
        _timed("text-cnn", "muon", 100.0),
        _timed("text-cnn", "muon+kfac", 100.4),
        _timed("text-cnn", "muon+kfac-ns3", 104.0),
        _timed("text-cnn", "adamw+kfac-lean", 97.0),
    ]
    lm, cnn = step_cost_checks(records)
    assert lm.compared == "muon+kfac-lean / muon" and lm.ratio == pytest.approx(0.99)
    assert lm.verdict == "met" and lm.why == "muon+kfac (the defaults) 1.17×"
    # the cheapest on any base, the cheapest on Muon itself beside it
    assert cnn.compared == "adamw+kfac-lean / muon" and cnn.verdict == "met"
    # two decimals would round 1.004 onto the bar it misses
    assert cnn.why == "on muon: muon+kfac 1.004×, muon+kfac (the defaults) 1.004×"
    (only_muon,) = step_cost_checks(records[4:7])
    assert only_muon.verdict == "missed" and "| 1.004× | missed |" in markdown_goals([only_muon])
    assert [c.verdict for c in step_cost_checks([])] == ["not timed yet"]


def test_a_miss_reads_as_one() -> None:
    check = Check("time ≤ 0.85× the best peer", "x", 0.85, "a / b", math.inf)
    assert check.verdict == "missed" and "| misses the target | missed |" in markdown_goals([check])
    won = Check("time ≤ 0.85× the best peer", "x", 0.85, "a / b", 0.0)
    assert won.verdict == "met" and "the peer misses" in markdown_goals([won])


def test_the_command_prints_every_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kaisa_lab.cli.main import main

    assert main(["bench", "summary", "--goals", "--records", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("not measured yet") == 9  # 5 times at batch 32, b512's steps, 3 defaults
    assert out.count("not forecast yet") == 2 and "not timed yet" in out
