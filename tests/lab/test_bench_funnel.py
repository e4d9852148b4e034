"""The levers are tried cheaply first: text-cnn runs only those that did not
lose on text-lm.

``cases.LOST_ON_TEXT_LM`` is a decision read from text-lm-levers' held-out
seeds; these tests derive it again from the committed records, so a set
edited by hand, or records that no longer bear it out, fail here.
"""

from __future__ import annotations

from pathlib import Path

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import LOST_ON_TEXT_LM, get_case
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import lever_word
from kaisa_lab.bench.rows import heldout_rows, lever_pairs, paired_ratio

ROOT = Path(__file__).resolve().parents[2]
RECORDS = RecordStore(ROOT / "benchmarks" / "records")


def lost_levers(campaign: Campaign) -> set[str]:
    """The lever arms whose held-out time to target, over K-FAC's at the
    defaults on the same base and paired by seed, reads as a loss; and each
    K-FAC base all of whose levers lost."""
    lost, levers = set(), []
    for row, base in lever_pairs(heldout_rows(campaign)):
        assert base is not None, f"{row.arm.optimizer} + K-FAC is not held out"
        ratio = paired_ratio(row, base)
        assert ratio is not None, f"{row.arm.name} is not paired with its base"
        levers.append(row.arm)
        if lever_word(ratio) == "loss":
            lost.add(row.arm.name)
    for base in campaign.case.arms:
        own = [a.name for a in levers if a.optimizer == base.optimizer]
        if base.kfac and not base.tag and not base.knobs and own and set(own) <= lost:
            lost.add(base.name)
    return lost


def test_every_lever_of_text_lm_is_held_out() -> None:
    held = {r.arm.name for r in heldout_rows(Campaign(get_case("text-lm-levers"), RECORDS))}
    assert held == {a.name for a in get_case("text-lm-levers").arms}


def test_the_levers_text_cnn_drops_are_those_that_lost_on_text_lm() -> None:
    assert lost_levers(Campaign(get_case("text-lm-levers"), RECORDS)) == LOST_ON_TEXT_LM


def test_text_cnn_runs_every_other_arm_of_text_lm_levers() -> None:
    text_lm = [a.name for a in get_case("text-lm-levers").arms]
    text_cnn = [a.name for a in get_case("text-cnn-levers").arms]
    assert text_cnn == [name for name in text_lm if name not in LOST_ON_TEXT_LM]
    assert set(text_lm) > LOST_ON_TEXT_LM
