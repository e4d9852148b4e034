"""The suite's one way to compare costs: arms timed in turns, never one after another.

On a shared machine the cost of a step moves with the load, so arms timed one
after the other are not comparable: whatever else the machine did lands on
one arm. :func:`interleave` runs every arm's step in turn (``block`` steps
each, ``rounds`` times), so a change of load falls on every arm alike, and
reports each arm's per-step times. :func:`alternate` does the same for whole
processes — two source trees, or two commands — in fresh interpreters taking
turns, which is how a code change is judged before and after.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Timing", "alternate", "interleave"]


@dataclass(frozen=True)
class Timing:
    """Per-step wall times of one arm (ms), and their median and quartiles."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def quartiles(self) -> tuple[float, float, float]:
        if len(self.samples_ms) < 2:
            return (self.median_ms,) * 3
        q1, q2, q3 = statistics.quantiles(self.samples_ms, n=4, method="inclusive")
        return q1, q2, q3

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)

    def summary(self) -> dict[str, float]:
        """What a record keeps: median, quartiles, mean and the count."""
        q1, median, q3 = self.quartiles()
        return {
            "median_ms": median,
            "q1_ms": q1,
            "q3_ms": q3,
            "mean_ms": self.mean_ms,
            "count": float(len(self.samples_ms)),
        }


def interleave(
    arms: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    block: int = 1,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time each arm's step in turns: ``block`` steps of each arm, ``rounds`` times.

    ``warmup`` untimed rounds come first (allocations, lazy set-up,
    compilation). ``sync`` is called before each reading of the clock (on a
    GPU, ``torch.cuda.synchronize``, so queued work is charged to the step
    that launched it). Every step is timed on its own: a block amortises
    nothing, it only sets how often the arms alternate (a block of an
    interval's length holds one factor step of a K-FAC arm)."""
    if rounds < 1 or block < 1 or warmup < 0:
        raise ValueError(
            f"need rounds >= 1, block >= 1, warmup >= 0; got {rounds}, {block}, {warmup}"
        )
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for index in range(warmup + rounds):
        for name, step in arms.items():
            for _ in range(block):
                if sync is not None:
                    sync()
                start = clock()
                step()
                if sync is not None:
                    sync()
                if index >= warmup:
                    samples[name].append(1e3 * (clock() - start))
    return {name: Timing(tuple(values)) for name, values in samples.items()}


def alternate(
    sides: Mapping[str, Sequence[str]],
    *,
    rounds: int,
    env: Mapping[str, Mapping[str, str]] | None = None,
    cwd: Path | None = None,
) -> dict[str, list[Any]]:
    """Run each side's Python command in a fresh interpreter, taking turns, ``rounds`` times.

    ``sides`` maps a side's name to the interpreter's arguments (a script and
    its arguments, or ``-m module ...``). Each must print one JSON document as
    the last line of its
    standard output; the parsed documents are returned per side, in round
    order. ``env`` adds variables per side (e.g. ``PYTHONPATH`` pointing at
    one source tree), so two versions of the code are measured in the same
    minutes of the machine's life."""
    out: dict[str, list[Any]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, argv in sides.items():
            full_env = {**os.environ, **(env or {}).get(name, {})}
            done = subprocess.run(
                [sys.executable, *argv],
                capture_output=True,
                text=True,
                env=full_env,
                cwd=cwd,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"{name}: {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
            lines = done.stdout.strip().splitlines()
            out[name].append(json.loads(lines[-1]))
    return out
