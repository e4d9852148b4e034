"""Median and spread over seeds of what ``kaisa compare --seeds N`` measures.

One seed says little about an optimizer: on small tasks the time to target
moves by a whole epoch between seeds. This module turns the per-seed records of
one arm (``results.json``'s ``seeds`` entries) into a summary, and works on
those plain records rather than on live runs so a saved file can be
re-summarised.

The rule for runs that never reach the target: their time, steps and epochs to
target count as **+infinity**. Order statistics then stay meaningful without
dropping runs (dropping them would make an optimizer that usually fails look
fast): the median is infinite exactly when the middle run(s) missed — more
than half of the seeds for odd N, half or more for even N (the mean of the two
middle values is infinite if either is). Infinite values are written as
``null`` in JSON (which has no infinity) and as ``not reached`` in the table;
``reached``/``not_reached`` give the counts. A final metric that is NaN (a
diverged run) counts as the worst possible value, for the same reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TO_TARGET_KEYS",
    "Spread",
    "paired_ratios",
    "quantile",
    "ratio_of_medians",
    "summarize_seeds",
    "to_target_values",
]

#: Per-seed quantities that are infinite for a run that missed the target.
TO_TARGET_KEYS = ("time_to_target_s", "steps_to_target", "epochs_to_target")

#: The interquartile range needs at least this many seeds to say more than min-max.
MIN_SEEDS_FOR_IQR = 4


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` by linear interpolation (numpy's default).

    Written out because numpy interpolates ``inf - inf`` into NaN, whereas a
    quantile that falls between a finite value and +inf is +inf here.
    """
    if not values:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1]; got {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    fraction = position - low
    if fraction == 0.0:
        return ordered[low]
    a, b = ordered[low], ordered[low + 1]
    if math.isinf(b) or math.isinf(a):
        return b if math.isinf(b) and b > 0 else a
    return a + (b - a) * fraction


@dataclass(frozen=True)
class Spread:
    """Median, range and (from :data:`MIN_SEEDS_FOR_IQR` values) quartiles of values."""

    median: float
    min: float
    max: float
    q1: float | None = None
    q3: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        quartiles = (
            (quantile(values, 0.25), quantile(values, 0.75))
            if len(values) >= MIN_SEEDS_FOR_IQR
            else (None, None)
        )
        return cls(quantile(values, 0.5), min(values), max(values), *quartiles)

    def to_dict(self) -> dict[str, float]:
        """JSON-ready; the quartiles only when there are enough values to have them."""
        out = {"median": self.median, "min": self.min, "max": self.max}
        if self.q1 is not None and self.q3 is not None:
            out.update(q1=self.q1, q3=self.q3)
        return out


def to_target_values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """``key`` of every record, with a missed target (``None``) as +infinity."""
    return [math.inf if r[key] is None else float(r[key]) for r in records]


def _final_metrics(records: Sequence[Mapping[str, Any]], higher_is_better: bool) -> list[float]:
    worst = -math.inf if higher_is_better else math.inf
    values = []
    for record in records:
        value = record["final_metric"]
        values.append(worst if value is None or math.isnan(value) else float(value))
    return values


def summarize_seeds(records: Sequence[Mapping[str, Any]], higher_is_better: bool) -> dict[str, Any]:
    """The summary of one arm from its per-seed records (``seed``, ``*_to_target``, ...)."""
    if not records:
        raise ValueError("cannot summarise zero seeds")
    reached = sum(r["time_to_target_s"] is not None for r in records)
    summary: dict[str, Any] = {
        "n_seeds": len(records),
        "seeds": [r["seed"] for r in records],
        "reached": reached,
        "not_reached": len(records) - reached,
    }
    for key in TO_TARGET_KEYS:
        summary[key] = Spread.of(to_target_values(records, key)).to_dict()
    summary["final_metric"] = Spread.of(_final_metrics(records, higher_is_better)).to_dict()
    summary["wall_time_s"] = Spread.of([float(r["wall_time_s"]) for r in records]).to_dict()
    return summary


def ratio_of_medians(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator`` of two medians, or None unless both are finite and > 0.

    A ratio against a median that never reached the target (or from one)
    would be 0 or infinity, which reads as a measurement; the counts of runs
    that missed say it better.
    """
    if not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator <= 0:
        return None
    return numerator / denominator


def paired_ratios(
    records: Sequence[Mapping[str, Any]], baseline: Sequence[Mapping[str, Any]]
) -> list[float]:
    """Per seed, an arm's time to target over the baseline's on the same seed.

    The arms of one seed share initial weights and batches, so the ratio per
    seed removes the seed's own luck that a ratio of medians keeps; only seeds
    where both reached the target count (a missed one has no time to divide).
    """
    base = {r["seed"]: r["time_to_target_s"] for r in baseline}
    out = []
    for record in records:
        mine, theirs = record["time_to_target_s"], base.get(record["seed"])
        if mine is not None and theirs is not None and theirs > 0:
            out.append(float(mine) / float(theirs))
    return out
