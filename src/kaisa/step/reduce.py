"""Factor reduction: every rank's sums and counts, added up on each factor's owner.

The layout is fixed once, at construction, from the work plan: every factor
of every layer has a *slot* in a flat bucket bound for its owner (buckets by
owner and dtype, at most ``bucket_cap`` bytes, in the order backward
completes layers), and buckets are sent in one fixed order.  So on a factor
step every rank takes part in exactly the same collectives with exactly the
same layout, whatever it captured: a layer a rank did not use (conditional
computation), or whose gradient it never saw, sends zeros with a count of
zero.  Sums are divided by the counts of all ranks (reduced alongside), so
the factors are the statistics of all rows seen on all ranks, however they
were split — unequal local batches included.

A bucket leaves as soon as its layers are complete *and* every earlier bucket
has left, so reductions overlap the rest of backward without ever depending
on the order in which layers happen to finish on one rank.

What is reduced is what the curvature method declared
(:attr:`KFACLayer.statistics`): a statistic reduced to an ``OWNER`` (A, G)
goes to its factor's owner; one reduced to the ``WORKERS`` (EKFAC's second
moment) is summed onto every rank — only plans where every rank is a
gradient worker of the layer allow such statistics (:mod:`kaisa.wiring`) —
and folded into the method's state there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kaisa.core.specs import ReducedTo
from kaisa.core.statistics import fold_averages_
from kaisa.distributed.communicator import Communicator, pack, unpack
from kaisa.distributed.messages import COUNT_DTYPE, statistic_numel
from kaisa.distributed.plan import WorkPlan
from kaisa.layers.state import KFACLayer
from kaisa.step.profile import FOLD, StepProfile

__all__ = ["EVERY_RANK", "FactorReduction"]

#: the "owner" of a bucket summed onto every rank (statistics reduced to the workers)
EVERY_RANK = -1


@dataclass
class _Slot:
    layer: KFACLayer
    index: int  #: statistic index in the layer (a factor's index for its statistic)
    offset: int
    numel: int
    symmetric: bool


@dataclass
class _Bucket:
    owner: int
    dtype: torch.dtype
    slots: list[_Slot] = field(default_factory=list)
    numel: int = 0
    filled: int = 0
    buffer: Tensor | None = None
    sent: bool = False


class FactorReduction:
    """Reduces batch factors onto their owners and folds them into running averages.

    Args:
        layers: the registered layers, in registration order.
        plan: who owns which factor.
        comm: the data-parallel communicator.
        bucket_cap_mb: bucket size; 0 sends every factor on its own.
        symmetry_aware: send dense factors as triangles.
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        plan: WorkPlan,
        comm: Communicator,
        *,
        bucket_cap_mb: float,
        symmetry_aware: bool,
    ) -> None:
        self.layers = layers
        self.plan = plan
        self.comm = comm
        self.rank = comm.rank
        #: told what is folded while a profile is attached (:mod:`kaisa.step.profile`)
        self.profile: StepProfile | None = None
        self._slots: dict[str, list[tuple[_Bucket, _Slot]]] = {la.name: [] for la in layers}
        self._buckets = self._layout(int(bucket_cap_mb * 1024 * 1024), symmetry_aware)
        self._next = 0  # the next bucket to send
        #: layers whose slots hold this step's sums, with the counts sent with them
        self._filled: dict[str, list[float]] = {}
        self._reduced: dict[tuple[str, int], Tensor] = {}
        #: this step's statistics are dropped, not folded (:meth:`forget_batch`)
        self._forget = False

    def _layout(self, cap: int, symmetry_aware: bool) -> list[_Bucket]:
        open_: dict[tuple[int, torch.dtype], _Bucket] = {}
        buckets: list[_Bucket] = []
        position: dict[int, int] = {}  # id(bucket) -> position of its last slot
        for pos, layer in enumerate(reversed(self.layers)):  # backward order
            owners = self.plan.layer(layer.name).owners
            for i, stat in enumerate(layer.statistics):
                owner = EVERY_RANK if stat.factor is None else owners[stat.factor]
                dtype = layer.dtype_of(stat)
                key = (owner, dtype)
                symmetric = symmetry_aware and stat.symmetric
                numel = statistic_numel(stat, symmetry_aware)
                bucket = open_.get(key)
                size = dtype.itemsize
                if bucket is None or (bucket.slots and (bucket.numel + numel) * size > cap):
                    bucket = _Bucket(owner, dtype)
                    open_[key] = bucket
                    buckets.append(bucket)
                slot = _Slot(layer, i, bucket.numel, numel, symmetric)
                bucket.slots.append(slot)
                bucket.numel += numel
                position[id(bucket)] = pos
                self._slots[layer.name].append((bucket, slot))
        # send in the order the buckets are expected to complete
        return sorted(buckets, key=lambda b: position[id(b)])

    # -- filling and sending ------------------------------------------------------
    def layer_complete(self, layer: KFACLayer) -> None:
        """Backward-hook callback: copy the layer's sums into its slots, send what is ready."""
        if not self.comm.distributed or layer.name in self._filled:
            return
        self._fill(layer)
        self._send_ready()

    def _fill(self, layer: KFACLayer) -> None:
        # later calls (past accumulation_steps) would add to the sums but not to
        # what was sent: the counts travel as they were when the sums left
        self._filled[layer.name] = list(layer.batch.counts)
        for bucket, slot in self._slots[layer.name]:
            if bucket.buffer is None:
                device = layer.adapter.device
                bucket.buffer = torch.zeros(bucket.numel, dtype=bucket.dtype, device=device)
            value = layer.batch.sums[slot.index]
            target = bucket.buffer[slot.offset : slot.offset + slot.numel]
            if value is None:
                target.zero_()
            else:
                target.copy_(pack(value, slot.symmetric))
            bucket.filled += 1

    def _send_ready(self, force: bool = False) -> None:
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if not force and bucket.filled < len(bucket.slots):
                return
            assert bucket.buffer is not None
            if bucket.owner == EVERY_RANK:
                self.comm.allreduce_sum(
                    bucket.buffer, self._receiver(bucket), kind="statistic_allreduce"
                )
            else:
                self.comm.reduce_sum(bucket.buffer, bucket.owner, self._receiver(bucket))
            bucket.sent = True
            self._next += 1

    def _receiver(self, bucket: _Bucket) -> Callable[[list[Tensor]], None]:
        def store(received: list[Tensor]) -> None:
            flat = received[0]
            for slot in bucket.slots:
                shape = torch.Size(slot.layer.statistics[slot.index].shape)
                segment = flat[slot.offset : slot.offset + slot.numel]
                self._reduced[(slot.layer.name, slot.index)] = unpack(
                    segment, shape, slot.symmetric
                )

        return store

    # -- at step() ------------------------------------------------------------------
    def exchange(self) -> list[float]:
        """Finish every reduction (those backward hooks started included) and
        return the counts of all ranks, factor by factor.  Must run before any
        other collective of the step: a rank whose hooks sent a bucket during
        backward has that reduction queued ahead of anything else."""
        if not self.comm.distributed:
            for layer in self.layers:
                for i, value in enumerate(layer.batch.sums):
                    if value is not None:
                        self._reduced[(layer.name, i)] = value
            return [c for layer in self.layers for c in layer.batch.counts]
        for layer in self.layers:
            if layer.name not in self._filled:
                self._fill(layer)
        self._send_ready(force=True)
        counts = torch.tensor(
            [c for layer in self.layers for c in self._filled[layer.name]], dtype=COUNT_DTYPE
        )
        device = self.layers[0].adapter.device
        received: list[Tensor] = []
        self.comm.allreduce_sum(counts.to(device), received.extend, kind="factor_counts")
        self.comm.wait()
        reduced: list[float] = received[0].cpu().tolist()  # one host sync per factor step
        self._reset_buckets()
        return reduced

    def discard(self) -> None:
        """Forget what :meth:`exchange` reduced and this step's statistics."""
        self._reduced.clear()
        for layer in self.layers:
            layer.batch.reset()

    def forget_batch(self) -> None:
        """Fold none of the statistics captured since the last step
        (kfac-pytorch's ``reset_batch()``).  The reductions backward started
        still complete at the step, on every rank, and are then dropped."""
        self._forget = True

    def end_step(self) -> None:
        """The step is over (taken, replayed or skipped): a later capture folds again."""
        self._forget = False

    def fold(self, counts: list[float], decay: float) -> bool:
        """Divide by the counts and fold into the running averages — a
        factor's on its owner, a workers' statistic into the method's state
        on each gradient worker — all at once
        (:func:`~kaisa.core.statistics.fold_averages_`).  False: nothing
        folded, the statistics forgotten (:meth:`forget_batch`)."""
        if self._forget:
            self.discard()
            return False
        # what each folded batch belongs to: (layer, factor index), or (layer, None) for a state
        owners: list[tuple[KFACLayer, int | None]] = []
        runnings: list[Tensor | None] = []
        batches: list[Tensor] = []
        divisors: list[float] = []
        k = 0
        for layer in self.layers:
            lp = self.plan.layer(layer.name)
            for i, stat in enumerate(layer.statistics):
                count = counts[k]
                k += 1
                if count <= 0:
                    continue
                reduced = self._reduced.pop((layer.name, i), None)
                if stat.reduced_to is ReducedTo.WORKERS:
                    running = layer.state_average(stat.name)
                    if reduced is None or running is None or not lp.is_grad_worker(self.rank):
                        continue
                    owners.append((layer, None))
                else:
                    layer.captured = True
                    assert stat.factor is not None
                    if lp.owners[stat.factor] != self.rank or reduced is None:
                        continue
                    running = layer.running[stat.factor]
                    owners.append((layer, stat.factor))
                runnings.append(running)
                batches.append(reduced)
                divisors.append(count)
            layer.batch.reset()
        self._reduced.clear()
        if self.profile is not None:
            for batch in batches:
                self.profile.record(FOLD, "fold", batch.shape)
        grams = [index is not None for _, index in owners]  # factors; a method's state is not
        verdicts = fold_averages_(runnings, batches, divisors, decay, grams) if batches else []
        for (layer, index), batch, finite in zip(owners, batches, verdicts, strict=True):
            if index is not None:
                layer.folded(index, batch, finite)
            elif not finite:
                layer.rejected()
        return True

    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.buffer = None
            bucket.filled = 0
            bucket.sent = False
        self._next = 0
        self._filled.clear()
