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

The draw is integer arithmetic on the layer's device, not a host generator:
each position gets the score ``h(key ⊕ t)`` under a bijective 32-bit mixing
``h``, and the ``k`` lowest scores are kept (scores are distinct, so there
are no ties to break).  The step enters through one integer tensor per
device (:meth:`PositionSampler.place`), written in place when the step
changes, so a compiled forward reads the step's draw as a graph input: one
graph for every factor step, instead of a graph frozen at its first draw or
rebuilt at every one.  The same arithmetic in eager code and in a graph, on
a CPU and on a GPU, gives the same positions.

This is the curvature-from-a-subsample-of-the-tokens idea (1/8–1/16 of the
positions, as on the modded-nanogpt optimisation track); kaisa's lever
measurements are on ``docs/reports/levers.md`` and
``docs/reports/large-batch.md``.
"""

from __future__ import annotations

import zlib
from fractions import Fraction
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["PositionSampler"]

_MASK32 = 0xFFFFFFFF
_Int = TypeVar("_Int", int, Tensor)


def _times(x: _Int, c: int) -> _Int:
    """``x·c mod 2³²`` for ``x`` in [0, 2³²) without leaving int64: the
    product is split at 16 bits (each part under 2⁴⁹)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * c + (((high * c) & 0xFFFF) << 16)) & _MASK32


def _mix(x: _Int) -> _Int:
    """A bijection of [0, 2³²) whose every output bit depends on every input
    bit (the xor-shift-multiply finaliser of Wellons' "lowbias32"); on Python
    ints and on int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _times(x, 0x846CA68B)
    return x ^ (x >> 16)


#: the factors' names as numbers, formed in eager code (:func:`_name_code`);
#: kaisa's own (A, G) from import on
_NAME_CODES: dict[str, int] = {name: zlib.crc32(name.encode()) for name in ("A", "G")}


def _name_code(factor: str) -> int:
    """A factor's name as a number: its CRC-32, the same in every process
    (unlike Python's ``hash``).  Where dynamo traces a draw it reads this as
    a lookup in a dict, which every dynamo folds to a constant, not as zlib
    (which it cannot trace) or a loop over the name's bytes (which dynamo
    2.10 cannot trace); kaisa's factor names (A, G) are in the dict from
    import on, any other name from its first eager draw.  Nothing is
    marked for the compiler at import (a mark imports dynamo, 1.5 s of every
    ``import kaisa``)."""
    code = _NAME_CODES.get(factor)
    if code is None:
        code = _NAME_CODES[factor] = zlib.crc32(factor.encode())
    return code


def _salt(factor: str, positions: int, device: torch.device) -> int | Tensor:
    """What a draw's key is mixed with: the factor's name and the call's
    positions.  An int; a 0-d tensor on ``device`` where the positions are
    symbolic (one graph compiled for every sequence length)."""
    if isinstance(positions, int):
        return _mix(_name_code(factor) ^ _mix(positions))
    length = torch.full((), positions, dtype=torch.int64, device=device)
    return _mix(_name_code(factor) ^ _mix(length))


def _draw(key: Tensor, salt: int | Tensor, positions: int, k: int) -> Tensor:
    """The ``k`` positions of ``positions`` with the lowest scores
    ``h(h(key ⊕ salt) ⊕ t)``, sorted (int64, on ``key``'s device)."""
    base = _mix(key ^ salt)
    scores = _mix(torch.arange(positions, device=key.device) ^ base)
    return torch.topk(scores, k, largest=False, sorted=False).indices.sort().values


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
        #: ``f`` as a ratio of ints: ``⌈f·T⌉`` in integer arithmetic, which a
        #: graph compiled for every length forms from its symbol (a float
        #: would be one more symbol, which dynamo cannot carry into a backward)
        self._ratio = Fraction(self.fraction).limit_denominator(10**6).as_integer_ratio()
        self.seed = int(seed)
        self._step = 0
        #: the step's key on each device a layer lives on (:meth:`place`)
        self._keys: dict[torch.device, Tensor] = {}
        #: the draws of this step, by (factor, positions, device): the same
        #: for every call in one step, and formed once (eager calls only)
        self._drawn: dict[tuple[str, int, torch.device], Tensor] = {}

    @property
    def step(self) -> int:
        """The step whose factor statistics are being captured."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if value == self._step:
            return
        self._step = int(value)
        self._drawn.clear()
        key = self._key()
        for held in self._keys.values():
            held.fill_(key)

    def place(self, device: torch.device) -> Tensor:
        """The step's key on ``device``, made there on first use.  Called
        outside compiled code (when the layers' capture follows their
        devices), so that a graph finds it and reads it as an input."""
        device = torch.device(device)
        held = self._keys.get(device)
        if held is None:
            held = torch.tensor(self._key(), dtype=torch.int64, device=device)
            self._keys[device] = held
        return held

    def kept_count(self, positions: int) -> int:
        """How many of ``positions`` a call is read at: ``⌈f·T⌉``, with ``f``
        the nearest ratio of denominator at most 10⁶ (exact for a fraction
        written with up to six decimals: 0.3 reads 3/10, not the float's
        binary value)."""
        num, den = self._ratio
        return min(positions, -(-num * positions // den))

    def kept(
        self, factor: str, positions: int, device: torch.device | str = "cpu"
    ) -> Tensor | None:
        """The sorted positions (int64, on ``device``) of a call of
        ``positions`` positions that ``factor`` (its name: A, G) reads at
        :attr:`step`; None: every one of them."""
        k = self.kept_count(positions)
        if k >= positions:
            return None
        device = torch.device(device)
        if torch.compiler.is_compiling():  # a graph input; nothing cached
            held = self._keys.get(device)
            if held is None:
                raise RuntimeError(
                    f"kaisa: no position key on {device}: PositionSampler.place({device!r}) "
                    "runs before a compiled forward on that device"
                )
            return _draw(held, _salt(factor, positions, device), positions, k)
        found = self._drawn.get((factor, positions, device))
        if found is None:
            salt = _salt(factor, positions, device)
            found = _draw(self.place(device), salt, positions, k)
            self._drawn[(factor, positions, device)] = found
        return found

    def _key(self) -> int:
        """The 32-bit key of ``(seed, step)`` (seeds and steps past 32 bits
        folded in by their high words)."""
        key = 0
        for part in (self.seed, self._step):
            while True:
                key = _mix(key ^ (part & _MASK32))
                part >>= 32
                if not part:
                    break
        return key
