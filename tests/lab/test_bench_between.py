"""A time to target read between evaluations: where each run's curve crossed
its target within the interval it was evaluated at, beside the measured
figure (a multiple of that interval), in the case tables, the levers and the
goals — and never in place of the measured figure."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from tests.lab.fake_campaign import fill, lr_bowl

from kaisa_lab.bench.campaign import Campaign, Run
from kaisa_lab.bench.report import markdown_between, markdown_heldout
from kaisa_lab.bench.rows import (
    evaluated_every,
    heldout_rows,
    paired_ratio,
    steps_between,
    steps_to_target,
    time_between,
    time_to_target,
)


def _record(
    points: list[tuple[int, float, float]], target: float, higher: bool = False
) -> dict[str, Any]:
    """A run's record from its evaluations ``(step, metric, clock)``, reached
    (or not) by the metric's own rule."""
    curve = [{"step": s, "metric": m, "time_s": t} for s, m, t in points]
    hit = next(
        (p for p in curve if (p["metric"] >= target if higher else p["metric"] <= target)), None
    )
    return {
        "result": {
            "reached": hit is not None,
            "target": target,
            "higher_is_better": higher,
            "steps_to_target": None if hit is None else hit["step"],
            "time_to_target_s": None if hit is None else hit["time_s"],
        },
        "curve": curve,
    }


def test_a_loss_crossing_is_read_on_the_line_between_its_two_evaluations() -> None:
    record = _record([(20, 3.0, 2.0), (40, 2.6, 4.5), (60, 2.4, 6.5)], target=2.5)
    assert steps_to_target(record) == 60 and time_to_target(record) == 6.5
    # the loss falls 0.2 over the interval and crosses 2.5 halfway down it
    assert steps_between(record) == pytest.approx(50.0)
    assert time_between(record) == pytest.approx(5.5)


def test_an_accuracy_crossing_is_read_upwards() -> None:
    record = _record([(10, 0.80, 1.0), (20, 0.90, 2.0), (30, 0.96, 3.0)], target=0.95, higher=True)
    assert steps_to_target(record) == 30
    assert steps_between(record) == pytest.approx(20 + 10 * 5 / 6)
    assert time_between(record) == pytest.approx(2.0 + 5 / 6)


def test_edges_a_first_evaluation_an_exact_hit_a_miss_and_no_curve() -> None:
    # reached at the first evaluation: nothing before it to read from
    first = _record([(20, 2.4, 2.0), (40, 2.2, 4.0)], target=2.5)
    assert steps_between(first) == 20 and time_between(first) == 2.0
    # on the target at an evaluation: that evaluation
    exact = _record([(20, 2.7, 2.0), (40, 2.5, 4.0)], target=2.5)
    assert steps_between(exact) == pytest.approx(40.0)
    # a miss is infinitely slow, both ways
    miss = _record([(20, 2.7, 2.0), (40, 2.6, 4.0)], target=2.5)
    assert math.isinf(steps_between(miss)) and math.isinf(time_between(miss))
    # a record without a curve: its figures at the evaluation
    bare = {**first, "curve": []}
    assert steps_between(bare) == 20 and time_between(bare) == 2.0
    assert evaluated_every([first, exact]) == 20 and evaluated_every([bare]) is None


def _kfac_earlier(campaign: Campaign, run: Run) -> float:
    """Every arm's loss crosses the target within the same 20-step interval
    as the optimizer alone's, K-FAC's 8 steps sooner."""
    return lr_bowl(campaign, run) - (9.0 if run.arm.kfac else 1.0)


def test_the_between_table_shows_what_the_interval_hides(tmp_path: Path) -> None:
    campaign = fill(tmp_path / "records", "quick", _kfac_earlier, every=20)
    rows = {r.arm.name: r for r in heldout_rows(campaign)}
    sgd, kfac = rows["sgd"], rows["sgd+kfac"]
    # measured at the evaluations the two arms tie; between them K-FAC is 8 steps sooner
    assert paired_ratio(kfac, sgd, steps_to_target) == 1.0
    assert paired_ratio(kfac, sgd, steps_between) == pytest.approx(91 / 99)
    assert paired_ratio(kfac, sgd, time_between) == pytest.approx(91 / 99)
    # a clock read between evaluations is still a wall clock: runs trained
    # apart (not one lockstep group) do not pair, their steps still do
    apart = dataclasses.replace(
        kfac, records=tuple({**r, "group": f"later-{r['seed']}"} for r in kfac.records)
    )
    assert paired_ratio(apart, sgd, time_between) is None
    assert paired_ratio(apart, sgd, steps_between) == pytest.approx(91 / 99)
    table = markdown_between(campaign)
    head, _, *lines = table.splitlines()
    assert head.startswith("| arm | evaluated every (steps) | steps to target |")
    cells = {c[0]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in lines)}
    seeds = len(campaign.protocol.heldout_seeds)
    assert len(cells) == 3 and all(c[1] == "20" for c in cells.values())
    assert cells["sgd"][2] == "100 [100–100]" and cells["sgd"][3] == "99 [99–99]"
    kfac_row = cells["sgd + K-FAC (library defaults)"]
    assert kfac_row[2] == "100 [100–100]" and kfac_row[3] == "91 [91–91]"
    # against the best first-order arm and against its base (here both sgd)
    assert kfac_row[4:] == ["1.00", "0.92", "1.00", "0.92"]
    assert cells["sgd"][6:] == ["-", "-"]
    # the held-out table, the protocol's, keeps the measured figures
    assert "| 100 [100–100] |" in markdown_heldout(campaign)
    assert all(r.seeds == seeds for r in rows.values())


def test_the_goals_say_both_and_judge_by_the_measured_ratio(tmp_path: Path) -> None:
    from kaisa_lab.bench.goals import defaults_check, time_check

    campaign = fill(tmp_path / "records", "quick", _kfac_earlier, every=20)
    check = time_check(campaign, limit=0.95)
    # measured: a tie (1.00×), so missed at 0.95 though 0.92× between evaluations
    assert check.ratio == 1.0 and check.verdict == "missed"
    assert "steps 1.00× (0.92× between evaluations)" in check.why
    assert check.why.endswith("time 0.92× between evaluations")
    # the defaults' check reads only arms on AdamW: the quick case has none
    assert defaults_check(campaign).verdict == "not measured yet"


def test_a_case_without_held_out_records_says_so(tmp_path: Path) -> None:
    campaign = fill(tmp_path / "records", "quick", rounds=1)
    assert markdown_between(campaign) == "_No held-out records yet._\n"
