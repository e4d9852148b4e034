"""Per-layer K-FAC state: batch statistics, running factors, second-order tensors.

A :class:`KFACLayer` owns tensors and nothing else; *which* of them a rank
keeps is decided by the work plan (:mod:`kaisa.distributed.plan`), what the second-order
tensors are by the curvature method (:mod:`kaisa.methods`), and when they
change by the step pipeline (:mod:`kaisa.step.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kaisa.core.precision import CastCopies
from kaisa.core.specs import FactorSpec, StatisticDtype, StatisticSpec, factor_statistics
from kaisa.core.statistics import fold_averages_
from kaisa.layers.base import LayerAdapter

__all__ = ["BatchStatistics", "GroupKey", "KFACLayer", "PendingCapture", "SecondOrderState"]

#: a group of one layer's forward calls: (root pass, backwards seen), or
#: (-1, the backward a recomputed call runs in)
GroupKey = tuple[int, int]


@dataclass
class PendingCapture:
    """Raw (input, output-gradient) pairs kept until ``step()`` when
    ``update_factors_in_hook=False``: ``(x, g, batch, multiplier, pass)``."""

    calls: list[tuple[Tensor, Tensor, int, float | Tensor, tuple[int, int]]] = field(
        default_factory=list
    )


class BatchStatistics:
    """Sums and counts of one layer since the last factor update.

    ``sums[i]`` is the unnormalised contribution to statistic ``i`` (the
    factors first, in their order, then any the method adds); ``counts[i]``
    what it will be divided by once the sums and counts of every rank have
    been added up (rows for input factors, data points for output-gradient
    factors).  A forward call adds nothing until its output gradient arrives,
    so a forward that is never followed by a backward leaves no trace.
    """

    def __init__(self, n_factors: int) -> None:
        self.n_factors = n_factors
        #: the layer's backwards so far (:meth:`forward_group`), counted
        #: across steps so that a hook of an earlier step never reads a later group
        self._generation = 0
        self._backward_seen = False
        self.reset()

    def reset(self) -> None:
        self.sums: list[Tensor | None] = [None] * self.n_factors
        self.counts: list[float] = [0.0] * self.n_factors
        self.calls = 0  #: forward calls whose statistics were committed
        self.pending_forwards = 0  #: forward calls still waiting for their gradient
        #: a call was recomputed during backward (reentrant activation
        #: checkpointing): how many more will come is not known before step()
        self.recomputed = False
        self.passes = 0  #: distinct forward passes (micro-batches) that reached the layer
        self._last_pass: tuple[int, int] | None = None
        #: per group of forward calls, the largest batch any of them saw
        self._group_batch: dict[GroupKey, int] = {}

    def note_forward(self, batch: int, pass_id: int, recomputed_in: int | None) -> GroupKey:
        """Count a captured forward call of ``batch`` (its gradient is now
        pending) and return the group of the layer's calls it joins: one
        micro-batch's calls.  A forward of the model's root starts a new
        pass, and a backward of the layer a new generation (where the root
        is not called, as under Lightning, every micro-batch shares one
        pass); a call recomputed during backward (reentrant activation
        checkpointing, whose first forward ran without grad) is grouped by
        the backward it runs in, ``recomputed_in``, and marks the layer."""
        if recomputed_in is not None:
            self.recomputed = True
            key: GroupKey = (-1, recomputed_in)
        else:
            self.pending_forwards += 1
            if self._backward_seen:
                self._generation += 1
                self._backward_seen = False
            key = (pass_id, self._generation)
        self._group_batch[key] = max(batch, self._group_batch.get(key, 0))
        return key

    def note_backward(self, recomputed: bool) -> None:
        """A call's output gradient arrived: it is no longer pending, and a
        later forward starts a new group."""
        self._backward_seen = True
        if not recomputed:
            self.pending_forwards -= 1

    def complete(self, accumulation_steps: int) -> bool:
        """Whether every pass of the step has reached the layer and left
        nothing pending, so its sums may be sent before ``step()``.  A
        recomputing backward may yet reach other calls of the layer
        (another checkpointed segment): such a layer waits for ``step()``."""
        return (
            self.pending_forwards == 0 and not self.recomputed and self.passes >= accumulation_steps
        )

    @property
    def started(self) -> bool:
        """Whether this step's passes have begun to reach the layer."""
        return bool(self.passes or self.pending_forwards)

    def batch_of(self, group: GroupKey, batch: int) -> int:
        """The data points of a call of ``group``: the group's widest batch.
        A module called on parts of the batch (an RNN cell stepping the rows
        still running) sees all of them in one call, and the loss averages
        over all of them, so every call of the micro-batch takes that one
        ``N`` (in ``ĝ = N·g`` and in G's normaliser), in whatever order the
        calls' gradients arrive."""
        return max(batch, self._group_batch.get(group, 0))

    def add(self, index: int, value: Tensor) -> None:
        current = self.sums[index]
        if current is None:
            self.sums[index] = value
        else:
            current.add_(value)

    def new_pass(self, pass_id: tuple[int, int]) -> bool:
        """Record that ``pass_id`` reached the layer; True the first time it does."""
        if pass_id == self._last_pass:
            return False
        self._last_pass = pass_id
        self.passes += 1
        return True

    @property
    def has_data(self) -> bool:
        return self.calls > 0


class SecondOrderState(dict[str, Tensor]):
    """A layer's second-order tensors, by the method's names, with a
    :attr:`generation` that counts every change of which tensor a key holds.

    What reads the tensors by address (a replayed CUDA graph,
    :mod:`kaisa.step.graphed`) compares generations instead of being told of
    each new decomposition or load; writes into a held tensor in place keep
    the generation (the address still holds the current values)."""

    __slots__ = ("generation",)

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def __setitem__(self, key: str, value: Tensor) -> None:
        self.generation += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.generation += 1
        super().__delitem__(key)

    def clear(self) -> None:
        self.generation += 1
        super().clear()

    def pop(self, key: str, *default: Any) -> Any:
        self.generation += 1
        return super().pop(key, *default)

    def popitem(self) -> tuple[str, Tensor]:
        self.generation += 1
        return super().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.generation += 1
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.generation += 1
        super().update(*args, **kwargs)

    def __ior__(self, other: Any) -> SecondOrderState:  # type: ignore[misc,override]
        self.update(other)
        return self


class KFACLayer:
    """The K-FAC state of one registered module.

    Attributes:
        factors: the specs of its Kronecker factors (from the adapter).
        statistics: what the curvature method needs per factor step (the
            factors first, in their order; :meth:`CurvatureMethod.statistics`).
        running: the running factors, ``None`` where this rank does not own one.
        state: the curvature method's second-order tensors, keyed by the
            method's own names (this rank holds them only as a gradient worker);
            its ``generation`` moves whenever a key is given another tensor.
        cast: their copies in ``precondition_dtype`` (:meth:`operands`).
        captured: statistics exist for the layer somewhere in the data-parallel
            group (the same on every rank: decided from reduced counts).
        decomposed: its second-order tensors were computed at least once.
    """

    def __init__(
        self,
        adapter: LayerAdapter,
        factor_dtype: torch.dtype,
        inv_dtype: torch.dtype,
        precondition_dtype: torch.dtype | None = None,
        statistics: tuple[StatisticSpec, ...] | None = None,
    ) -> None:
        self.adapter = adapter
        self.name = adapter.name
        self.factors: tuple[FactorSpec, ...] = adapter.effective_specs()
        self.statistics = factor_statistics(self.factors) if statistics is None else statistics
        if self.statistics[: len(self.factors)] != factor_statistics(self.factors):
            raise ValueError(
                f"layer {self.name!r}: a method's statistics must start with the layer's "
                "factors, in their order (CurvatureMethod.statistics)"
            )
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.batch = BatchStatistics(len(self.statistics))
        self.pending = PendingCapture()
        self.running: list[Tensor | None] = [None] * len(self.factors)
        self.state = SecondOrderState()
        #: ``state`` in ``precondition_dtype``, cached per inverse update
        self.cast = CastCopies(precondition_dtype)
        self.captured = False
        self.decomposed = False
        #: the last forward seen with gradients enabled ran in eval mode (not captured)
        self.eval_forward = False
        self.failed_decompositions = 0
        self.decompositions = 0  #: factors this rank has decomposed
        self._rejected = 0  # non-finite batch statistics left out of their averages

    def __repr__(self) -> str:
        return f"KFACLayer({self.name!r}, {self.adapter.describe()})"

    @property
    def preconditions(self) -> bool:
        """Whether the layer has what a step preconditions with: statistics
        captured, or second-order state restored whole from a checkpoint that
        lacks its factors (kept until the inverse update after its next
        capture).  The same on every rank: both are decided alike everywhere."""
        return self.captured or self.decomposed

    def index(self, name: str) -> int:
        for i, spec in enumerate(self.factors):
            if spec.name == name:
                return i
        raise KeyError(f"layer {self.name!r} has no factor {name!r}")

    def factor(self, name: str) -> Tensor | None:
        """The running factor called ``name`` (``None`` where not kept here)."""
        return self.running[self.index(name)]

    def fold(self, index: int, batch: Tensor, decay: float) -> None:
        """Fold one reduced batch factor into the running average (the step
        folds every layer's at once: :meth:`kaisa.step.reduce.FactorReduction.fold`).

        A non-finite batch factor leaves the running factor unchanged."""
        (finite,) = fold_averages_([self.running[index]], [batch], [1.0], decay)
        self.folded(index, batch, finite)

    def folded(self, index: int, batch: Tensor, finite: bool) -> None:
        """After :func:`~kaisa.core.statistics.fold_averages_`: the first
        finite batch factor starts the running one; a non-finite one is counted."""
        if not finite:
            self.rejected()
        elif self.running[index] is None:
            self.running[index] = batch.clone()

    def dtype_of(self, statistic: StatisticSpec) -> torch.dtype:
        """The dtype ``statistic`` is formed, reduced and kept in."""
        second_order = statistic.dtype is StatisticDtype.SECOND_ORDER
        return self.inv_dtype if second_order else self.factor_dtype

    def state_average(self, key: str) -> Tensor | None:
        """The running average a ``WORKERS`` statistic folds into, kept in
        the method's state (None where the method holds no such tensor yet:
        nothing to fold)."""
        return self.state.get(key)

    def rejected(self) -> None:
        """Count a non-finite batch statistic left out of its average."""
        self._rejected += 1

    def operands(self) -> dict[str, Tensor]:
        """What the curvature method applies: :attr:`state`, or its cast copies
        when ``precondition_dtype`` differs from ``inv_dtype``."""
        return self.cast.of(self.state)

    @property
    def nonfinite_updates(self) -> int:
        """How many batch statistics were rejected as non-finite."""
        return self._rejected

    def memory(self) -> dict[str, int]:
        """Bytes held for this layer, by kind."""

        def nbytes(t: Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        pending = sum(nbytes(c[0]) + nbytes(c[1]) for c in self.pending.calls)
        return {
            "factors": sum(nbytes(t) for t in self.running),
            "batch_statistics": sum(nbytes(t) for t in self.batch.sums) + pending,
            # the cast copies of precondition_dtype are second-order tensors too
            "second_order": sum(nbytes(t) for t in self.state.values()) + self.cast.nbytes(),
        }
