"""The median/spread over seeds of ``kaisa compare --seeds`` and its rule for missed targets."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kaisa_lab.cli.results import write_results
from kaisa_lab.cli.summary import paired_ratios, quantile, ratio_of_medians, summarize_seeds


def record(seed: int, time: float | None, final: float = 0.9) -> dict[str, Any]:
    """A per-seed record; ``time=None`` is a run that never reached the target."""
    reached = time is not None
    return {
        "seed": seed,
        "time_to_target_s": time,
        "steps_to_target": 10 * seed + 5 if reached else None,
        "epochs_to_target": seed + 1 if reached else None,
        "final_metric": final,
        "wall_time_s": 3.0 + seed,
    }


def test_quantile_matches_numpy_on_finite_values() -> None:
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 7):
        values = [rng.uniform(-5, 5) for _ in range(n)]
        for q in (0.0, 0.25, 0.5, 0.75, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_a_minority_of_misses_leaves_the_median_finite() -> None:
    records = [record(0, 2.0), record(1, None), record(2, 1.0)]
    summary = summarize_seeds(records, higher_is_better=True)
    assert summary["reached"] == 2 and summary["not_reached"] == 1
    times = summary["time_to_target_s"]
    assert times["median"] == 2.0  # sorted: 1.0, 2.0, inf
    assert times["min"] == 1.0 and math.isinf(times["max"])
    assert "q1" not in times  # three seeds: no quartiles
    assert summary["steps_to_target"]["median"] == 25.0  # 5, 25, inf


@pytest.mark.parametrize(
    "times",
    [
        [2.0, None, None],  # odd N: more than half missed
        [2.0, None],  # even N: half missed, the middle pair holds an infinity
        [None, None, None, None],
    ],
)
def test_the_median_is_not_reached_when_the_middle_runs_missed(
    times: list[float | None],
) -> None:
    records = [record(i, t) for i, t in enumerate(times)]
    summary = summarize_seeds(records, higher_is_better=True)
    assert math.isinf(summary["time_to_target_s"]["median"])
    assert math.isinf(summary["epochs_to_target"]["median"])
    assert summary["not_reached"] == sum(t is None for t in times)


def test_quartiles_from_four_seeds_and_infinity_between_finite_and_missed() -> None:
    records = [record(i, t) for i, t in enumerate([4.0, 1.0, None, 2.0])]
    times = summarize_seeds(records, higher_is_better=True)["time_to_target_s"]
    finite = [1.0, 2.0, 4.0]  # the quartiles only touch finite values here...
    assert times["q1"] == pytest.approx(float(np.quantile([*finite, 1e300], 0.25)))
    assert times["median"] == pytest.approx(statistics.median([*finite, math.inf]))
    assert math.isinf(times["q3"])  # ...but q3 lies between 4.0 and the missed run


def test_a_nan_final_metric_counts_as_the_worst() -> None:
    records = [record(0, 1.0, final=math.nan), record(1, 1.0, 0.5), record(2, 1.0, 0.7)]
    higher = summarize_seeds(records, higher_is_better=True)["final_metric"]
    assert higher["median"] == 0.5 and higher["min"] == -math.inf
    lower = summarize_seeds(records, higher_is_better=False)["final_metric"]
    assert lower["median"] == 0.7 and lower["max"] == math.inf


def test_ratio_of_medians_only_between_finite_medians() -> None:
    assert ratio_of_medians(1.0, 4.0) == 0.25
    assert ratio_of_medians(math.inf, 4.0) is None
    assert ratio_of_medians(1.0, math.inf) is None
    assert ratio_of_medians(math.inf, math.inf) is None


def test_infinities_are_written_as_null(tmp_path: Path) -> None:
    summary = summarize_seeds([record(0, None), record(1, None)], higher_is_better=True)
    write_results(tmp_path / "r.json", [{"summary": summary}])
    (saved,) = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"]["time_to_target_s"] == {"median": None, "min": None, "max": None}


def test_zero_seeds_is_an_error() -> None:
    with pytest.raises(ValueError, match="zero seeds"):
        summarize_seeds([], higher_is_better=True)


def test_paired_ratios_divide_seed_by_seed_and_skip_missed_seeds() -> None:
    def runs(times: dict[int, float | None]) -> list[dict[str, Any]]:
        return [{"seed": seed, "time_to_target_s": t} for seed, t in times.items()]

    baseline = runs({0: 10.0, 1: 20.0, 2: None, 3: 8.0})
    arm = runs({3: 6.0, 0: 7.0, 1: None, 2: 5.0})  # order does not matter: paired by seed
    assert paired_ratios(arm, baseline) == pytest.approx([0.75, 0.7])
    assert paired_ratios(runs({5: 1.0}), baseline) == []  # no seed in common


def test_seed_table_prints_the_ratio_of_medians_and_per_seed() -> None:
    from kaisa_lab.cli.results import format_seed_table

    def arm(name: str, times: list[float | None]) -> dict[str, Any]:
        seeds = [
            {"seed": i, "time_to_target_s": t, "steps_to_target": None if t is None else 10,
             "epochs_to_target": None if t is None else 1, "final_metric": 0.9,
             "wall_time_s": 1.0}
            for i, t in enumerate(times)
        ]  # fmt: skip
        return {"name": name, "task": "t", "metric_name": "accuracy", "target": 0.9,
                "higher_is_better": True, "seeds": seeds, "summary": summarize_seeds(seeds, True)}  # fmt: skip

    base, kfac = arm("sgd", [10.0, 20.0, 30.0, 40.0]), arm("sgd+kfac", [6.0, 16.0, None, 20.0])
    kfac["summary"]["time_to_target_ratio"] = ratio_of_medians(20.0, 25.0)
    ratios = paired_ratios(kfac["seeds"], base["seeds"])
    assert ratios == pytest.approx([0.6, 0.8, 0.5])
    kfac["summary"]["time_to_target_ratio_per_seed"] = {"median": 0.6, "min": 0.5, "max": 0.8,
                                                        "n_seeds": 3}  # fmt: skip
    text = format_seed_table([base, kfac])
    assert "sgd+kfac / sgd: 0.80; per seed 0.60 [0.50-0.80]" in text
    assert "over the 3 seeds where both reached it" in text
