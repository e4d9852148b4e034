"""The comparison's step costs, ratios and verdicts (``kaisa_lab.cli.verdict``), on
hand-made ``results.json`` arms whose answers are known."""

from __future__ import annotations

from typing import Any

import pytest

from kaisa_lab.cli.results import format_seed_table, format_table
from kaisa_lab.cli.summary import ratio_of_medians, summarize_seeds
from kaisa_lab.cli.verdict import TIE_BAND, best_first_order, compare_arms, step_cost_s


def arm(
    optimizer: str, kfac: bool, steps: int | None, time_s: float | None, seeds: int = 1
) -> dict[str, Any]:
    """One arm as ``arms_to_dicts`` writes it; ``steps``/``time_s`` None: target missed
    (trained 400 steps in 40 s). Every seed gets the same numbers."""
    last_step, last_time = (steps, time_s) if steps and time_s else (400, 40.0)
    records = [
        {
            "seed": seed,
            "time_to_target_s": time_s,
            "steps_to_target": steps,
            "epochs_to_target": None if steps is None else steps / 200,
            "final_metric": 2.45 if steps else 2.7,
            "wall_time_s": last_time,
            "curve": [{"epoch": 0.1, "step": last_step, "wall_time_s": last_time, "metric": 2.45}],
        }
        for seed in range(seeds)
    ]
    return {
        "name": f"{optimizer}+kfac" if kfac else optimizer,
        "optimizer": optimizer,
        "kfac": kfac,
        "task": "text-lm",
        "target": 2.5,
        "metric_name": "bits_per_char",
        "higher_is_better": False,
        "config": {"seed": 0},
        **{k: v for k, v in records[0].items() if k not in ("seed", "curve")},
        "curve": records[0]["curve"],
        "seeds": records,
        "summary": summarize_seeds(records, higher_is_better=False),
    }


def compared(*arms: dict[str, Any]) -> list[dict[str, Any]]:
    """The arms with the ratios to the first that ``arms_to_dicts`` adds, then compared."""
    base = arms[0]["summary"]["time_to_target_s"]["median"]
    for other in arms[1:]:
        median = other["summary"]["time_to_target_s"]["median"]
        other["summary"]["time_to_target_ratio"] = ratio_of_medians(median, base)
    out = list(arms)
    compare_arms(out)
    return out


def demo_like() -> list[dict[str, Any]]:
    """Medians like text-lm's: AdamW 360 steps, +K-FAC 220, Muon 160, +K-FAC 140."""
    return compared(
        arm("adamw", False, 360, 36.0),
        arm("adamw", True, 220, 24.2),
        arm("muon", False, 160, 16.0),
        arm("muon", True, 140, 15.6),
    )


def test_step_cost_is_training_time_over_steps() -> None:
    assert step_cost_s(arm("adamw", False, 360, 36.0)["seeds"][0]) == pytest.approx(0.1)
    assert step_cost_s({"curve": []}) is None


def test_kfac_is_judged_against_its_own_base_optimizer() -> None:
    arms = demo_like()
    adamw_kfac, muon_kfac = arms[1]["summary"]["kfac_vs_base"], arms[3]["summary"]["kfac_vs_base"]
    assert adamw_kfac["base"] == "adamw" and muon_kfac["base"] == "muon"
    assert adamw_kfac["steps_ratio"] == pytest.approx(220 / 360)
    assert adamw_kfac["step_cost_ratio"] == pytest.approx((24.2 / 220) / 0.1)
    assert adamw_kfac["time_ratio"] == pytest.approx(24.2 / 36.0)
    assert adamw_kfac["verdict"] == "faster"
    # 15.6 / 16.0 = 0.975: within the tie band, so not called faster.
    assert muon_kfac["time_ratio"] == pytest.approx(0.975) and muon_kfac["verdict"] == "tie"
    assert "kfac_vs_base" not in arms[0]["summary"] and "kfac_vs_base" not in arms[2]["summary"]


def test_the_bar_is_the_fastest_arm_without_kfac() -> None:
    arms = demo_like()
    assert best_first_order(arms) is arms[2]
    for a in arms:
        vs = a["summary"]["time_vs_best_first_order"]
        assert vs["arm"] == "muon"
        assert vs["ratio"] == pytest.approx(a["time_to_target_s"] / 16.0)


@pytest.mark.parametrize(
    ("kfac_time", "verdict"),
    [
        (10.0 * (1 - TIE_BAND) - 0.01, "faster"),
        (10.0 * (1 - TIE_BAND) + 0.01, "tie"),
        (10.0 * (1 + TIE_BAND) - 0.01, "tie"),
        (10.0 * (1 + TIE_BAND) + 0.01, "slower"),
    ],
)
def test_tie_band_edges(kfac_time: float, verdict: str) -> None:
    arms = compared(arm("muon", False, 100, 10.0), arm("muon", True, 90, kfac_time))
    assert arms[1]["summary"]["kfac_vs_base"]["verdict"] == verdict


def test_a_missed_target_is_not_comparable() -> None:
    arms = compared(arm("adamw", False, 360, 36.0), arm("adamw", True, None, None))
    verdict = arms[1]["summary"]["kfac_vs_base"]
    assert verdict["verdict"] == "not comparable" and verdict["time_ratio"] is None
    assert verdict["step_cost_ratio"] == pytest.approx(1.0)  # 400 steps in 40 s both
    assert "K-FAC on adamw: never steps against 360" in format_table(arms)


def test_table_says_steps_cost_ratios_and_verdicts() -> None:
    text = format_table(demo_like())
    lines = text.splitlines()
    assert lines[0] == "text-lm: target bits_per_char <= 2.5; seed 0"
    header = lines[1]
    for column in ("steps to target", "time to target (s)", "ms/step", "time vs adamw"):
        assert column in header
    assert "time vs muon" in header
    muon_kfac = next(line for line in lines if line.startswith("muon+kfac "))
    # steps, time, ms/step, vs adamw, vs muon
    assert muon_kfac.split()[1:6] == ["140", "15.60", "111", "0.43", "0.97"]
    assert "K-FAC on adamw: 220 steps against 360 (0.61x), each step 1.10x the cost: " in text
    assert "0.67x the time to target -> K-FAC is faster." in text
    assert "K-FAC on muon: 140 steps against 160 (0.88x)" in text and "a tie (within 5%" in text
    assert "Fastest to the target: muon+kfac, 0.97x the time of the fastest optimizer " in text
    assert "One seed: these verdicts hold for this seed only" in text


def test_a_lone_run_has_no_ratio_columns() -> None:
    (only,) = compared(arm("adamw", False, 360, 36.0))
    text = format_table([only])
    assert "ms/step" not in text and "K-FAC on" not in text


def test_seed_table_carries_the_verdicts() -> None:
    arms = compared(arm("muon", False, 160, 16.0, seeds=3), arm("muon", True, 140, 14.0, seeds=3))
    arms[1]["summary"]["time_to_target_ratio_per_seed"] = None
    text = format_seed_table(arms)
    assert "K-FAC on muon: 140 steps against 160 (0.88x)" in text and "K-FAC is faster" in text
    assert "One seed" not in text


def test_a_changing_load_is_named_and_a_steady_one_is_not() -> None:
    """The verdict says when the step times spread (the machine's load moved), since the
    time ratios are then uncertain while the steps are not."""
    from kaisa_lab.cli.verdict import LOAD_BAND, verdict_lines

    def with_spread(arms: list[dict[str, Any]], spread: float) -> list[dict[str, Any]]:
        for a in arms:
            for record in a["seeds"]:
                record["step_times"] = {
                    "median_ms": 100.0,
                    "q1_ms": 100.0,
                    "q3_ms": 100 + 100 * spread,
                    "count": 50,  # a spread over a few steps says nothing: 20 at least
                }
        return arms

    steady = verdict_lines(with_spread(demo_like(), LOAD_BAND / 2))
    assert not any("load changed" in line for line in steady)
    busy = verdict_lines(with_spread(demo_like(), 0.4))
    (said,) = [line for line in busy if "load changed" in line]
    assert "spread by up to 40%" in said and "read the steps first" in said
    assert verdict_lines(demo_like()) == steady  # records without step times: nothing said
    short = with_spread(demo_like(), 0.4)
    for a in short:
        for record in a["seeds"]:
            record["step_times"]["count"] = 5
    assert verdict_lines(short) == steady  # five steps' spread: nothing said
