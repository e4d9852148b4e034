"""The levers are tried cheaply first: text-cnn runs only those that did not
lose steps on text-lm.

``cases.LOST_ON_TEXT_LM`` is a decision read from text-lm-levers' selection
seeds; these tests derive it again from the committed records, so a set
edited by hand, or records that no longer bear it out, fail here.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import LOST_ON_TEXT_LM, STEPS_LOST, Arm, get_case
from kaisa_lab.bench.records import RecordStore

ROOT = Path(__file__).resolve().parents[2]
RECORDS = RecordStore(ROOT / "benchmarks" / "records")


def _median_steps(campaign: Campaign, arm: Arm) -> float:
    """The median steps to target of ``arm``'s selected setting on the
    selection seeds (a miss: infinitely many)."""
    state = campaign.state(arm)
    assert state.selected is not None, f"{arm.name} is still tuning on {campaign.case.name}"
    seeds = campaign.protocol.selection_seeds
    outcomes = campaign.outcomes(arm, state.selected, seeds)
    return statistics.median(math.inf if o.steps is None else o.steps for o in outcomes)


def lost_levers(campaign: Campaign) -> set[str]:
    """The lever arms whose steps exceed their base's by more than
    :data:`STEPS_LOST`, and each K-FAC base all of whose levers lost."""
    arms = campaign.case.arms
    bases = {a.optimizer: a for a in arms if a.kfac and not a.tag and not a.knobs}
    levers = [a for a in arms if a.tag]
    base_steps = {o: _median_steps(campaign, a) for o, a in bases.items()}
    lost = {
        a.name for a in levers if _median_steps(campaign, a) > STEPS_LOST * base_steps[a.optimizer]
    }
    for optimizer, base in bases.items():
        own = [a.name for a in levers if a.optimizer == optimizer]
        if own and set(own) <= lost:
            lost.add(base.name)
    return lost


def test_the_levers_text_cnn_drops_are_those_that_lost_steps_on_text_lm() -> None:
    assert lost_levers(Campaign(get_case("text-lm-levers"), RECORDS)) == LOST_ON_TEXT_LM


def test_text_cnn_runs_every_other_arm_of_text_lm_levers() -> None:
    text_lm = [a.name for a in get_case("text-lm-levers").arms]
    text_cnn = [a.name for a in get_case("text-cnn-levers").arms]
    assert text_cnn == [name for name in text_lm if name not in LOST_ON_TEXT_LM]
    assert set(text_lm) > LOST_ON_TEXT_LM
