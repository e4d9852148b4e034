"""What the step's collectives send, declared before any tensor exists.

The step builds its messages from these declarations and the planner
(:mod:`kaisa.planner.forecast`) counts the same ones, so a change to what
the step sends moves the forecast with it.  Nothing here calls
``torch.distributed``: it is sizes only.

* a factor step reduces each statistic's sums (:func:`statistic_numel`
  elements in a bucket) and one count per statistic (:data:`COUNT_DTYPE`);
* under ``grad_worker_fraction < 1`` a layer's gradient worker sends its
  receivers :func:`grad_message` every step;
* a symmetric part travels as its upper triangle when ``symmetry_aware``
  (:func:`message_numel`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = [
    "COUNT_DTYPE",
    "MessagePart",
    "Part",
    "grad_message",
    "message_numel",
    "packed_numel",
    "statistic_numel",
]

#: the dtype of the per-statistic row counts a factor step all-reduces
COUNT_DTYPE = torch.float64


class MessagePart(Protocol):
    """One tensor of a message, as declared before it exists: a method's
    :class:`~kaisa.methods.base.HeldTensor`, a layer's
    :class:`~kaisa.core.specs.StatisticSpec`, or a :class:`Part`."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def symmetric(self) -> bool: ...


@dataclass(frozen=True)
class Part:
    """A tensor of a message the step builds itself (a gradient, an inner product)."""

    shape: tuple[int, ...]
    symmetric: bool = False


def packed_numel(shape: torch.Size, symmetric: bool) -> int:
    if symmetric:
        n = shape[0]
        return n * (n + 1) // 2
    return int(torch.Size(shape).numel())


def message_numel(parts: Iterable[MessagePart], symmetry_aware: bool) -> int:
    """Elements one message of ``parts`` puts on the wire: what the step's
    collectives send (:meth:`~kaisa.distributed.communicator.Communicator.broadcast`
    packs a symmetric part's upper triangle when ``symmetry_aware``) and what
    the planner forecasts — the one rule both read."""
    return sum(packed_numel(torch.Size(p.shape), symmetry_aware and p.symmetric) for p in parts)


def statistic_numel(stat: MessagePart, symmetry_aware: bool) -> int:
    """Elements one statistic's sums take in a reduction bucket (and on the wire)."""
    return message_numel([stat], symmetry_aware)


def grad_message(matrix_shape: tuple[int, ...] | torch.Size) -> tuple[Part, Part]:
    """What a layer's gradient worker sends its receivers every step when
    ``grad_worker_fraction < 1``: the preconditioned gradient matrix and its
    ``⟨V, ∇⟩`` (one element), so the receivers need not hold the gradient
    for the KL clip."""
    return Part(tuple(matrix_shape)), Part((1,))
