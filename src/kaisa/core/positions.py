"""Factor statistics read from a fraction of a call's positions.

A sequence layer's factor terms cost ``N·T·d²``: every one of a call's ``T``
positions is a row of its Gram.  Reading a random ``k = ⌈f·T⌉`` of them cuts
a factor step's Grams to ``f`` of their cost, and each factor stays an
unbiased estimate of the full one:

- A is the *mean* of ``[a, 1][a, 1]ᵀ`` over the rows read, so it counts the
  ``N·k`` rows it read;
- G *sums* over positions (the loss gradient of a position is one term of a
  data point's gradient), so the kept positions' Gram is weighted ``T/k``.

Which positions are read is a function of ``(seed, step, factor, T)`` alone
(the factor: A or G), drawn afresh at every factor step, the same for every
call in that step and **the same on every rank**: a rank's share of the
batch reads the positions the whole batch would have read in one process,
so the factors — and with them the run — do not depend on the world size,
on ``grad_worker_fraction``, on how the batch is split into micro-batches or
the model into pipeline stages (whose layers a stage names apart from the
whole model), and a resumed run draws what the uninterrupted run drew
(nothing to save).  Layers share a step's draw: K-FAC's blocks are
independent, so each layer's factors are unbiased whatever the others read,
and layers that read one input (q, k and v) form one term whichever of them
forms it.

This is the curvature-from-a-subsample-of-the-tokens idea (1/8–1/16 of the
positions, as on the modded-nanogpt optimisation track); kaisa's lever
measurements are on ``docs/reports/levers.md`` and
``docs/reports/large-batch.md``.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

__all__ = ["PositionSampler"]

#: mixes the key's parts into one 63-bit seed (the SplitMix64 increment)
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


class PositionSampler:
    """Which of a call's positions a factor statistic reads.

    Args:
        fraction: ``f`` in (0, 1]: a call of ``T`` positions is read at
            ``⌈f·T⌉`` of them (all of them where that is ``T``).
        seed: the draws' seed; the same on every rank (a run's seed).

    :attr:`step` is set by the step pipeline before each step's forward.
    """

    def __init__(self, fraction: float, seed: int = 0) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"factor_position_fraction must be in (0, 1]; got {fraction!r}")
        self.fraction = float(fraction)
        self.seed = int(seed)
        #: the step whose factor statistics are being captured
        self.step = 0
        #: the draws of this step, by (factor, positions): the same for every
        #: call in one step, and formed once
        self._drawn: dict[tuple[str, int], Tensor | None] = {}
        self._drawn_at = -1

    def kept_count(self, positions: int) -> int:
        """How many of ``positions`` a call is read at."""
        return min(positions, math.ceil(self.fraction * positions))

    def kept(self, factor: str, positions: int) -> Tensor | None:
        """The sorted positions (int64, on the CPU) of a call of ``positions``
        positions that ``factor`` (its name: A, G) reads at :attr:`step`;
        None: every one of them."""
        k = self.kept_count(positions)
        if k >= positions:
            return None
        if self._drawn_at != self.step:
            self._drawn.clear()
            self._drawn_at = self.step
        key = (factor, positions)
        if key not in self._drawn:
            generator = torch.Generator().manual_seed(self._seed_of(factor, positions))
            drawn = torch.randperm(positions, generator=generator)[:k]
            self._drawn[key] = drawn.sort().values
        return self._drawn[key]

    def _seed_of(self, factor: str, positions: int) -> int:
        """One 63-bit seed from ``(seed, step, factor, positions)``: the name by
        its CRC-32 (the same in every process, unlike Python's ``hash``)."""
        value = 0
        for part in (self.seed, self.step, zlib.crc32(factor.encode()), positions):
            value = ((value ^ part) * _GOLDEN + _GOLDEN) & _MASK
        return value
