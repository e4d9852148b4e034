"""Settled settings: a setting whose deciding seeds already put it behind
another setting runs no more selection seeds, and the choice is the one the
missing runs would have left (kaisa_lab.bench.protocol.settled)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from fake_campaign import fill

from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.protocol import Outcome, Protocol, Setting, best, settled, work_base
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import markdown_tuning


def _o(steps: int | None, final: float | None = 1.0) -> Outcome:
    return Outcome(None if steps is None else float(steps), steps, final)


def _s(lr: float, kfac: tuple[tuple[str, object], ...] = ()) -> Setting:
    return Setting(lr, 0.0, "cosine", kfac)


def test_a_setting_behind_another_on_any_last_seed_is_settled() -> None:
    a, b, c, d = _s(0.1), _s(0.2), _s(0.4), _s(0.8)
    results = {
        a: [_o(300), _o(350)],  # its median is at most 350
        b: [_o(360), _o(400)],  # at least 360: behind a, whatever its last seed
        c: [_o(340), _o(500)],  # at least 340: could still beat a
        d: [_o(None), _o(None)],  # two misses: its median is a miss
    }
    assert settled(results, 3) == {b, d}
    # equal bounds are not enough: the tie-breaks could still choose it
    assert settled({a: [_o(300), _o(350)], b: [_o(350), _o(360)]}, 3) == set()
    # a setting whose steps are weighed by a step cost is never compared
    knob = _s(0.2, (("inv_update_steps", 50),))
    assert settled({a: [_o(300), _o(350)], knob: [_o(900), _o(900)]}, 3) == set()
    assert settled({knob: [_o(100), _o(100)], b: [_o(900), _o(900)]}, 3) == set()
    # a setting that may reach on most seeds is not settled by the final metric
    assert (
        settled({a: [_o(300, 3.0), _o(None, 3.0)], d: [_o(None, 2.0), _o(None, 2.0)]}, 3) == set()
    )
    # one that misses on most seeds whatever its last seed gives loses to a
    # setting whose worst median final metric beats its best
    e = _s(1.6)
    misses = {d: [_o(None, 2.0), _o(None, 2.5)], e: [_o(None, 2.6), _o(None, 3.0)]}
    assert settled(misses, 3) == {e}
    assert settled(misses, 3, higher_is_better=True) == {d}
    misses[e] = [_o(None, 2.4), _o(None, 3.0)]  # its best, 2.4, beats d's worst, 2.5
    assert settled(misses, 3) == set()
    misses[e] = [_o(None, float("nan")), _o(None, 3.0)]  # a diverged seed: unbounded
    assert settled(misses, 3) == set()
    # one seed of three bounds nothing
    assert settled({a: [_o(100)] * 3, b: [_o(900)]}, 3) == set()


@pytest.mark.parametrize("higher", [False, True])
def test_no_outcome_of_a_settled_settings_missing_seed_gets_it_selected(higher: bool) -> None:
    rng = random.Random(0)
    steps = [20, 40, 60, None, None]
    finals = [1.0, 2.0, 3.0, float("nan"), None]
    thirds = [(20, 1.0), (60, 3.0), (None, 1.0), (None, 2.0), (None, 3.0), (None, float("nan"))]
    checked = 0
    for _ in range(300):
        settings = [_s(0.1 * 2**i) for i in range(3)]
        known = {s: [_o(rng.choice(steps), rng.choice(finals)) for _ in range(2)] for s in settings}
        out = settled(known, 3, higher)
        if not out:
            continue
        # every setting's third seed, every way it could go
        for third in itertools.product(thirds, repeat=len(settings)):
            full = {s: [*known[s], _o(*t)] for s, t in zip(settings, third, strict=True)}
            assert best(full, higher) not in out, (known, third)
            checked += 1
    assert checked > 5000  # the property was tested on settled settings, many times


def test_the_deciding_seeds_are_the_first_half_of_the_selection_seeds() -> None:
    assert Protocol().deciding_seeds == (0, 1)
    assert Protocol(selection_seeds=(0,), heldout_seeds=(1,)).deciding_seeds == (0,)
    assert Protocol(selection_seeds=(0, 1, 2, 3, 4), heldout_seeds=(5,)).deciding_seeds == (
        0,
        1,
        2,
    )


def test_later_seeds_run_only_the_settings_left_in_play(tmp_path: Path) -> None:
    # no record yet: the later seed waits for the deciding ones
    empty = Campaign(get_case("digits-mlp"), RecordStore(tmp_path / "none"))
    assert {u.seed for u in empty.units()} == {0, 1}
    campaign = fill(tmp_path, "digits-mlp", rounds=1)
    assert {r["seed"] for r in campaign.every_record()} == {0, 1}
    assert {u.seed for u in campaign.units()} == {2}
    # lr_bowl: the prior lr without warm-up takes the fewest steps on every seed;
    # every other grid setting is behind it on its first two seeds
    campaign = fill(tmp_path, "digits-mlp")
    seeds = campaign.protocol.selection_seeds
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        assert state.stage == "done"
        assert state.selected is not None
        assert (state.selected.lr, state.selected.warmup_epochs) == (
            campaign.case.prior_lr(arm.optimizer),
            0.0,
        )
        assert len(state.tried) == campaign.protocol.budget  # the budget is spent
        for setting in state.tried:
            ran = {r["seed"] for r in campaign.records(arm, setting, seeds)}
            steps = [o.steps for o in campaign.outcomes(arm, setting, seeds)]
            chosen = [o.steps for o in campaign.outcomes(arm, state.selected, seeds)]
            assert ran >= {0, 1}
            behind = min(s for s in steps if s is not None) > max(
                s for s in chosen if s is not None
            )
            plain = work_base(setting) is None
            assert (ran == {0, 1}) == (behind and plain), (arm.name, setting)
    table = markdown_tuning(campaign)
    assert "(settled on 2 seeds)" in table
    assert "**" in table and "** (settled" not in table
    # nothing is left to run: the runs left out are not waited for
    assert campaign.units() == []
    assert all(campaign.runs_left(campaign.state(arm)) == 0 for arm in campaign.case.arms)
