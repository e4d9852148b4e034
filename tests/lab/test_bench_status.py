"""``kaisa bench status`` says how much of a campaign is left: about how many
runs (each arm's remaining budget on the selection seeds, then its held-out
seeds) and, at the pace of the runs recorded so far, one worker's hours."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from tests.lab.fake_campaign import fill

from kaisa_lab.bench.campaign import Campaign, duration
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import RecordStore

CASE = get_case("quick")
P = CASE.protocol
PER_ARM = P.budget * len(P.selection_seeds) + len(P.heldout_seeds)


def test_a_fresh_campaign_has_every_arms_budget_and_held_out_seeds_left(tmp_path: Path) -> None:
    campaign = Campaign(CASE, RecordStore(tmp_path))
    assert [campaign.runs_left(campaign.state(a)) for a in CASE.arms] == [PER_ARM] * len(CASE.arms)
    # nothing recorded yet: no pace to tell the hours by
    assert not any(line.startswith("left:") for line in campaign.status())


def test_the_runs_left_fall_as_records_arrive_and_each_arms_pace_gives_hours(
    tmp_path: Path,
) -> None:
    # a K-FAC step costs twice a plain one: its arms' runs take twice as long
    campaign = fill(tmp_path, "quick", step_s=lambda run: 1.2 if run.arm.kfac else 0.6, rounds=1)
    grid = len(CASE.grid(CASE.arms[0]))
    left = [campaign.runs_left(campaign.state(a)) for a in CASE.arms]
    # the first round is every arm's grid on the selection seed
    assert left == [PER_ARM - grid * len(P.selection_seeds)] * len(CASE.arms)
    line = next(line for line in campaign.status() if line.startswith("left:"))
    assert f"about {sum(left)} run(s)" in line
    paces = {
        kind: statistics.median(
            r["result"]["train_time_s"] for r in campaign.every_record() if r["arm"] == kind
        )
        for kind in {a.kind for a in CASE.arms}
    }
    need = sum(n * paces[a.kind] for a, n in zip(CASE.arms, left, strict=True))
    assert f"about {duration(need)} of one worker" in line
    assert paces["sgd+kfac"] > paces["sgd"]  # the two paces differ, so the test tells them apart


def test_a_run_two_arms_share_is_left_once(tmp_path: Path) -> None:
    """The tuned K-FAC arm's grid is the defaults' arm's (the same runs): two
    of its runs lost, each arm lacks them, and the line counts them once."""
    campaign = fill(tmp_path, "quick", rounds=1)
    defaults = CASE.arms[1]
    lost = [campaign.run(defaults, setting, 0, "").key for setting in CASE.grid(defaults)[:2]]
    for key in lost:
        (path,) = (tmp_path / "quick").glob(f"*/{key}-s0.json")
        path.unlink()
    campaign.refresh()
    states = [campaign.state(a) for a in CASE.arms]
    assert campaign.known_left(states[1]) == campaign.known_left(states[2]) == set(lost)
    left = [campaign.runs_left(st) for st in states]
    line = next(line for line in campaign.status() if line.startswith("left:"))
    assert f"about {sum(left) - len(lost)} run(s)" in line


@pytest.mark.parametrize(
    ("seconds", "text"), [(40.4, "40 s"), (750.0, "12.5 min"), (328_680.0, "91.3 h")]
)
def test_a_duration_reads_in_the_unit_a_person_reads_it_in(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_a_finished_campaign_has_nothing_left(tmp_path: Path) -> None:
    campaign = fill(tmp_path, "quick")
    assert [campaign.runs_left(campaign.state(a)) for a in CASE.arms] == [0] * len(CASE.arms)
    assert not any(line.startswith("left:") for line in campaign.status())
