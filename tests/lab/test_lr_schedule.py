"""The CLI's learning-rate schedule (:mod:`kaisa_lab.cli.schedule`) against its formula."""

from __future__ import annotations

import math

import pytest

from kaisa_lab.cli.schedule import LRSchedule


def test_warmup_then_cosine_matches_the_formula() -> None:
    schedule = LRSchedule.from_epochs("cosine", 0.2, 1.0, epochs=4, steps_per_epoch=10)
    assert (schedule.warmup_steps, schedule.total_steps) == (10, 40)
    # Warm-up: linear from base/10 to base.
    assert schedule.lr(0) == pytest.approx(0.02)
    assert schedule.lr(4) == pytest.approx(0.1)
    assert schedule.lr(9) == pytest.approx(0.2)
    # Cosine: base at the end of warm-up, half-way at the middle, near 0 at the end.
    assert schedule.lr(10) == pytest.approx(0.2)
    assert schedule.lr(25) == pytest.approx(0.1)
    assert schedule.lr(39) == pytest.approx(0.1 * (1 + math.cos(math.pi * 29 / 30)))
    assert 0 < schedule.lr(39) < 0.001
    lrs = [schedule.lr(s) for s in range(10, 40)]
    assert lrs == sorted(lrs, reverse=True)


def test_constant_without_warmup_is_the_identity() -> None:
    schedule = LRSchedule.from_epochs("constant", 0.05, 0.0, epochs=3, steps_per_epoch=7)
    assert schedule.is_identity
    assert {schedule.lr(s) for s in range(21)} == {0.05}


def test_constant_with_warmup_ramps_then_holds() -> None:
    schedule = LRSchedule.from_epochs("constant", 0.1, 0.5, epochs=2, steps_per_epoch=8)
    assert not schedule.is_identity and schedule.warmup_steps == 4
    assert [schedule.lr(s) for s in range(6)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1])


def test_cosine_without_warmup_starts_at_base() -> None:
    schedule = LRSchedule.from_epochs("cosine", 1.0, 0.0, epochs=1, steps_per_epoch=4)
    assert [schedule.lr(s) for s in range(4)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)]
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "linear"}, "schedule must be one of"),
        ({"base_lr": 0.0}, "base_lr"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 11}, "longer than training"),
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"name": "cosine", "base_lr": 0.1, "warmup_steps": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        LRSchedule(total_steps=10, **args)  # type: ignore[arg-type]
