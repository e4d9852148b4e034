"""What a comparison of several arms says, in the words a newcomer reads.

``kaisa compare --optimizers adamw,muon`` trains four arms (AdamW, AdamW+K-FAC,
Muon, Muon+K-FAC). Its table gives each arm's steps and time to target; this
module adds what a reader otherwise works out by hand:

- **step cost**: training time over optimizer steps (median over seeds), so the
  time to target splits into "fewer steps" and "dearer steps";
- **time against the baseline** (the first arm) **and against the fastest
  first-order arm** (the best optimizer without K-FAC: the bar a user compares with);
- **one verdict per K-FAC arm against its own base optimizer** (Muon+K-FAC
  against Muon): the ratio of steps, of step cost and of time, and whether that
  is faster, slower or a tie.

A tie is a time ratio within :data:`TIE_BAND` of 1: on one seed on a shared
machine the clock moves by a few percent from run to run, so a 3 % difference
is not a result, and saying "faster" there would oversell it.

It reads the ``results.json`` objects (their ``seeds`` and ``summary``), so a
saved file can be re-judged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kaisa_lab.cli.summary import Spread, quantile, ratio_of_medians

__all__ = [
    "TIE_BAND",
    "best_first_order",
    "compare_arms",
    "kfac_verdict",
    "step_cost_s",
    "verdict_lines",
]

#: Time ratios within this fraction of 1 are called a tie.
TIE_BAND = 0.05


def step_cost_s(record: Mapping[str, Any]) -> float | None:
    """Training seconds per optimizer step of one seed's run, or None before any step.

    Training time over the steps it covers (both from the last evaluation),
    so a run stopped at the target is costed over the steps it took.
    """
    curve = record.get("curve") or []
    if not curve or not curve[-1]["step"]:
        return None
    return float(curve[-1]["wall_time_s"]) / float(curve[-1]["step"])


#: step times spreading more than this (interquartile range over the median) mean
#: the machine's load moved while the arms trained: time ratios are then uncertain
LOAD_BAND = 0.10


def step_time_spread(arm: Mapping[str, Any]) -> float | None:
    """The widest spread of an arm's step times over its seeds (IQR / median), or None."""
    spreads = []
    for record in arm["seeds"]:
        times = record.get("step_times")
        # a few steps' spread says little about the machine: judge 20 or more
        if times and times["median_ms"] > 0 and times.get("count", 0) >= 20:
            spreads.append((times["q3_ms"] - times["q1_ms"]) / times["median_ms"])
    return max(spreads) if spreads else None


def _median_step_cost(arm: Mapping[str, Any]) -> float | None:
    costs = [c for c in (step_cost_s(s) for s in arm["seeds"]) if c is not None]
    return quantile(costs, 0.5) if costs else None


def _median(arm: Mapping[str, Any], key: str) -> float:
    """The arm's median of ``key`` (``*_to_target``) as a float, +inf when missed."""
    value = arm["summary"][key]["median"]
    return math.inf if value is None else float(value)


def best_first_order(arms: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The arm without K-FAC with the smallest median time to target (None if none reached)."""
    reached = [a for a in arms if not a["kfac"] and math.isfinite(_median(a, "time_to_target_s"))]
    return min(reached, key=lambda a: _median(a, "time_to_target_s"), default=None)


def _judge(ratio: float | None) -> str:
    if ratio is None:
        return "not comparable"
    if abs(ratio - 1.0) <= TIE_BAND:
        return "tie"
    return "faster" if ratio < 1.0 else "slower"


def kfac_verdict(arm: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """A K-FAC arm against its base optimizer's arm: ratios of medians and the verdict.

    ``verdict`` is ``faster``/``slower``/``tie`` (:data:`TIE_BAND`) by time to
    target, or ``not comparable`` when either median missed the target.
    """
    cost, base_cost = _median_step_cost(arm), _median_step_cost(base)
    time_ratio = ratio_of_medians(
        _median(arm, "time_to_target_s"), _median(base, "time_to_target_s")
    )
    return {
        "base": base["name"],
        "steps_ratio": ratio_of_medians(
            _median(arm, "steps_to_target"), _median(base, "steps_to_target")
        ),
        "step_cost_ratio": None if cost is None or not base_cost else cost / base_cost,
        "time_ratio": time_ratio,
        "verdict": _judge(time_ratio),
    }


def compare_arms(arms: Sequence[dict[str, Any]]) -> None:
    """Add ``step_cost_s``, ``time_vs_best_first_order`` and ``kfac_vs_base`` to each summary.

    ``kfac_vs_base`` only on a K-FAC arm whose optimizer also ran without K-FAC.
    """
    best = best_first_order(arms)
    plain = {a["optimizer"]: a for a in arms if not a["kfac"]}
    for arm in arms:
        summary = arm["summary"]
        costs = [c for c in (step_cost_s(s) for s in arm["seeds"]) if c is not None]
        summary["step_cost_s"] = Spread.of(costs).to_dict() if costs else None
        summary["time_vs_best_first_order"] = (
            None
            if best is None
            else {
                "arm": best["name"],
                "ratio": ratio_of_medians(
                    _median(arm, "time_to_target_s"), _median(best, "time_to_target_s")
                ),
            }
        )
        base = plain.get(arm["optimizer"])
        if arm["kfac"] and base is not None:
            summary["kfac_vs_base"] = kfac_verdict(arm, base)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _steps(arm: Mapping[str, Any]) -> str:
    steps = _median(arm, "steps_to_target")
    return "never" if math.isinf(steps) else f"{steps:g}"


def _say(verdict: str, subject: str) -> str:
    return {
        "faster": f"{subject} is faster",
        "slower": f"{subject} is slower",
        "tie": f"a tie (within {TIE_BAND:.0%}: not a difference this run can show)",
    }.get(verdict, "not comparable (the target was not reached)")


def verdict_lines(arms: Sequence[Mapping[str, Any]]) -> list[str]:
    """The sentences printed under the table (none for a lone arm).

    Reads what :func:`compare_arms` added; one line per K-FAC arm with its
    base, then the fastest arm overall against the fastest without K-FAC.
    """
    if len(arms) < 2 or any("kfac" not in a for a in arms):
        return []  # one arm, or records from before the optimizer was recorded
    by_name = {a["name"]: a for a in arms}
    lines = []
    for arm in arms:
        verdict = arm["summary"].get("kfac_vs_base")
        if verdict is None:
            continue
        base = by_name[verdict["base"]]
        lines.append(
            f"K-FAC on {base['name']}: {_steps(arm)} steps against {_steps(base)} "
            f"({_x(verdict['steps_ratio'])}), each step {_x(verdict['step_cost_ratio'])} the "
            f"cost: {_x(verdict['time_ratio'])} the time to target -> "
            f"{_say(verdict['verdict'], 'K-FAC')}."
        )
    best = best_first_order(arms)
    fastest = min(arms, key=lambda a: _median(a, "time_to_target_s"))
    if best is not None and fastest is not best:
        ratio = ratio_of_medians(
            _median(fastest, "time_to_target_s"), _median(best, "time_to_target_s")
        )
        lines.append(
            f"Fastest to the target: {fastest['name']}, {_x(ratio)} the time of the fastest "
            f"optimizer without K-FAC ({best['name']}) -> {_say(_judge(ratio), fastest['name'])}."
        )
    elif best is not None:
        lines.append(f"Fastest to the target: {best['name']}, without K-FAC.")
    spreads = [v for v in (step_time_spread(a) for a in arms) if v is not None]
    if lines and spreads and max(spreads) > LOAD_BAND:
        lines.append(
            f"The machine's load changed while the arms trained: their step times spread by "
            f"up to {max(spreads):.0%} (the middle half of the steps), so time ratios "
            f"within about ±{max(spreads):.0%} are uncertain; read the steps first, they are "
            "not affected."
        )
    if lines and arms[0]["summary"]["n_seeds"] == 1:
        # Steps to target move by a reading or two between seeds (Muon on text-lm:
        # 180 on seed 0, 160 on seeds 1-2), which is the size of these differences.
        lines.append(
            "One seed: these verdicts hold for this seed only; --seeds 3 measures them "
            "over three seeds, the numbers to quote."
        )
    return lines
