"""``kaisa compare --seeds N`` on tiny digits-mlp runs: records, summary, plot, table."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import pytest
from test_cli import QUICK, RUN_FIELDS, assert_valid_png, run_cli

from kaisa_lab.cli.main import main
from kaisa_lab.cli.plot import seed_bands

SEED_FIELDS = {
    "seed",
    "time_to_target_s",
    "steps_to_target",
    "epochs_to_target",
    "final_metric",
    "wall_time_s",
    "stopped",
    "step_times",
    "fingerprints",
    "curve",
}


def as_inf(value: float | None) -> float:
    """The summary's rule, restated: a missed target (null) is infinitely slow."""
    return math.inf if value is None else value


def from_json(value: float | None) -> float:
    """A saved summary statistic; null stands for infinity."""
    return math.inf if value is None else value


@pytest.fixture(scope="module")
def three_seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("seeds")
    args = ("compare", *QUICK, "--epochs", "2", "--target", "0.5", "--seed", "4", "--seeds", "3")
    return out, run_cli(out, *args)


def test_every_arm_records_every_seed(three_seeds: tuple[Path, list[dict[str, Any]]]) -> None:
    out, arms = three_seeds
    assert [a["name"] for a in arms] == ["sgd", "sgd+kfac"]
    for arm in arms:
        assert set(arm) >= RUN_FIELDS | {"seeds", "summary"}
        assert [s["seed"] for s in arm["seeds"]] == [4, 5, 6]
        for seed in arm["seeds"]:
            assert set(seed) == SEED_FIELDS
            assert [p["step"] for p in seed["curve"]] == [5, 10]
        # The original fields are the run on --seed itself.
        first = arm["seeds"][0]
        assert arm["config"]["seed"] == 4
        assert {k: arm[k] for k in SEED_FIELDS - {"seed"}} == {
            k: first[k] for k in SEED_FIELDS - {"seed"}
        }
        losses = [s["curve"][0]["train_loss"] for s in arm["seeds"]]
        assert len(set(losses)) == 3  # other seeds: other weights and batches
    assert_valid_png(out / "results.png")


def test_summary_is_the_median_and_range_of_the_records(
    three_seeds: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, arms = three_seeds
    medians = {}
    for arm in arms:
        summary, seeds = arm["summary"], arm["seeds"]
        assert summary["n_seeds"] == 3 and summary["seeds"] == [4, 5, 6]
        reached = sum(s["time_to_target_s"] is not None for s in seeds)
        assert (summary["reached"], summary["not_reached"]) == (reached, 3 - reached)
        for key in ("time_to_target_s", "steps_to_target", "epochs_to_target", "final_metric"):
            values = [as_inf(s[key]) for s in seeds]
            stats = summary[key]
            assert set(stats) == {"median", "min", "max"}  # no quartiles below 4 seeds
            assert from_json(stats["median"]) == pytest.approx(statistics.median(values))
            assert from_json(stats["min"]) == min(values)
            assert from_json(stats["max"]) == max(values)
        medians[arm["name"]] = statistics.median(as_inf(s["time_to_target_s"]) for s in seeds)
    assert "time_to_target_ratio" not in arms[0]["summary"]
    kfac = arms[1]["summary"]
    assert kfac["baseline"] == "sgd"
    assert kfac["time_to_target_ratio"] == pytest.approx(medians["sgd+kfac"] / medians["sgd"])
    ratios = [
        k["time_to_target_s"] / b["time_to_target_s"]
        for b, k in zip(arms[0]["seeds"], arms[1]["seeds"], strict=True)
        if k["time_to_target_s"] is not None and b["time_to_target_s"] is not None
    ]
    assert ratios  # a target of 0.5 is reached within 10 steps by both runs
    per_seed = kfac["time_to_target_ratio_per_seed"]
    assert per_seed["n_seeds"] == len(ratios)
    assert per_seed["median"] == pytest.approx(statistics.median(ratios))
    assert (per_seed["min"], per_seed["max"]) == pytest.approx((min(ratios), max(ratios)))


def test_plot_band_is_the_per_epoch_median(
    three_seeds: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, arms = three_seeds
    for arm in arms:
        bands = seed_bands(arm["seeds"])
        assert bands["epoch"] == [1, 2] and "q1" not in bands
        assert bands["step"] == [p["step"] for p in arm["seeds"][0]["curve"]]
        for i in range(len(bands["epoch"])):
            metrics = [s["curve"][i]["metric"] for s in arm["seeds"]]
            times = [s["curve"][i]["wall_time_s"] for s in arm["seeds"]]
            assert bands["median"][i] == pytest.approx(statistics.median(metrics))
            assert (bands["min"][i], bands["max"][i]) == (min(metrics), max(metrics))
            assert bands["time"][i] == pytest.approx(statistics.median(times))


def test_missed_targets_count_as_infinitely_slow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Accuracy can never reach 1.01: every run misses, so every median is infinite.
    arms = run_cli(tmp_path, "compare", *QUICK, "--epochs", "1", "--target", "1.01", "--seeds", "2")
    text = capsys.readouterr().out
    for arm in arms:
        summary = arm["summary"]
        assert (summary["reached"], summary["not_reached"]) == (0, 2)
        assert summary["time_to_target_s"] == {"median": None, "min": None, "max": None}
        assert summary["final_metric"]["median"] is not None
    assert arms[1]["summary"]["time_to_target_ratio"] is None
    assert arms[1]["summary"]["time_to_target_ratio_per_seed"] is None
    assert "0/2" in text and "not reached  " in text and "[inf-inf]" not in text
    assert "sgd+kfac / sgd: n/a" in text
    assert "run 4/4: sgd+kfac seed 1" in text  # progress over seeds x arms
    assert_valid_png(tmp_path / "results.png")


def test_bars_count_runs_across_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kaisa_lab.cli import progress

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    quick = [a for a in QUICK if a != "--quiet"]
    run_cli(tmp_path, "train", "--no-kfac", *quick, "--epochs", "1", "--seeds", "2")
    text = capsys.readouterr().out
    assert "runs: 100%" in text and "2/2" in text
    assert "[sgd seed 1] epoch 1/1 step 5 train_loss" in text  # the epoch's line stays


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_seeds_is_refused_naming_the_option(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *QUICK, "--seeds", value, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "argument --seeds" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_bands_of_uneven_curves_use_the_seeds_that_evaluated_each_epoch() -> None:
    """Seeds stopped early (--stop-at-target) or diverged (null metric) drop out of an epoch."""

    def seed(metrics: list[float | None]) -> dict[str, Any]:
        curve = [
            {"epoch": e, "step": 10 * e, "wall_time_s": float(e), "metric": m}
            for e, m in enumerate(metrics, 1)
        ]
        return {"curve": curve}

    seeds = [seed([0.1, 0.5]), seed([0.2]), seed([0.3, None, 0.9]), seed([0.4, 0.7])]
    bands = seed_bands(seeds)
    assert bands["epoch"] == [1, 2, 3] and bands["step"] == [10, 20, 30]
    assert bands["median"] == pytest.approx([0.25, 0.6, 0.9])
    assert bands["min"] == [0.1, 0.5, 0.9] and bands["max"] == [0.4, 0.7, 0.9]
    assert bands["q1"][0] == pytest.approx(0.175) and bands["q3"][0] == pytest.approx(0.325)
