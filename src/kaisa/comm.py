"""Every ``torch.distributed`` call kaisa makes lives in this module.

:class:`Communicator` creates its process groups once (a private copy of the
world, so K-FAC traffic never interleaves with DDP's gradient buckets, plus
one group per worker group and per receiver group of the work plan) and
offers three bucketed, asynchronous collectives:

* :meth:`Communicator.reduce_mean` — average a tensor over all ranks *onto
  one owner* (the rank that decomposes the factor); nobody else keeps it;
* :meth:`Communicator.broadcast` — from a source rank to a group (eigenbases
  to gradient workers, preconditioned gradients to receivers);
* :meth:`Communicator.allreduce_sum` — small vectors (traces for the π-split).

Each call only *enqueues*; tensors are packed into flat buckets of at most
``bucket_cap_mb`` keyed by (kind, group ranks, root, dtype) — group identity,
never group size — and launched when a bucket fills or on :meth:`flush`.
:meth:`wait` completes everything and runs the completion callbacks.
With ``symmetry_aware`` only the upper triangle of a symmetric matrix is sent.

With one process every operation completes immediately and moves no data.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CommStats", "CommunicationError", "Communicator", "dist_info"]

Callback = Callable[[list[Tensor]], None]


def dist_info() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CommunicationError(RuntimeError):
    """A K-FAC collective failed or timed out (a rank died or never arrived)."""


@dataclass
class CommStats:
    """Bytes and calls per collective kind: for the last step, and in total.

    Traffic launched from backward hooks belongs to the step that follows, so
    the running count is only closed (and becomes ``step``) by
    :meth:`end_step`, at the end of ``KFACPreconditioner.step()``.
    """

    step: dict[str, dict[str, int]] = field(default_factory=dict)
    total: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(_zero))
    current: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(_zero))

    def record(self, kind: str, nbytes: int) -> None:
        for table in (self.current, self.total):
            table[kind]["calls"] += 1
            table[kind]["bytes"] += nbytes

    def end_step(self) -> None:
        self.step = {k: dict(v) for k, v in self.current.items()}
        self.current = defaultdict(_zero)

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        return {
            "step": {k: dict(v) for k, v in self.step.items()},
            "total": {k: dict(v) for k, v in self.total.items()},
        }


def _zero() -> dict[str, int]:
    return {"calls": 0, "bytes": 0}


def _pack(t: Tensor, symmetric: bool) -> Tensor:
    if symmetric:
        n = t.shape[0]
        idx = torch.triu_indices(n, n, device=t.device)
        return t[idx[0], idx[1]]
    return t.reshape(-1)


def _packed_numel(shape: torch.Size, symmetric: bool) -> int:
    if symmetric:
        n = shape[0]
        return n * (n + 1) // 2
    return int(torch.Size(shape).numel())


def _unpack(flat: Tensor, shape: torch.Size, symmetric: bool) -> Tensor:
    if symmetric:
        n = shape[0]
        idx = torch.triu_indices(n, n, device=flat.device)
        out = flat.new_empty(n, n)
        out[idx[0], idx[1]] = flat
        out[idx[1], idx[0]] = flat
        return out
    return flat.reshape(shape)


@dataclass
class _Item:
    tensors: list[Tensor]
    symmetric: list[bool]
    callback: Callback | None


@dataclass
class _Bucket:
    items: list[_Item] = field(default_factory=list)
    numel: int = 0


@dataclass
class _Launched:
    kind: str
    work: Any
    flat: Tensor
    items: list[_Item]
    finish: Callable[[Tensor], Tensor]


class Communicator:
    """Bucketed asynchronous collectives over the groups of one work plan.

    Args:
        groups: every rank set the plan will use as a broadcast group; a
            process group is created for each (in sorted order, on every rank).
        bucket_cap_mb: bucket size; 0 sends each tensor on its own.
        symmetry_aware: send only the upper triangle of symmetric matrices.
        timeout_s: timeout of the groups created here (None: the default's).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[int]] = (),
        *,
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        self.rank, self.world_size = dist_info()
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.symmetry_aware = symmetry_aware
        self.timeout_s = timeout_s
        self.stats = CommStats()
        self._groups: dict[tuple[int, ...], Any] = {}
        self._pending: dict[tuple[Any, ...], _Bucket] = {}
        self._launched: list[_Launched] = []
        if self.world_size > 1:
            kwargs: dict[str, Any] = {}
            timeout = (
                datetime.timedelta(seconds=timeout_s)
                if timeout_s is not None
                else _default_group_timeout()
            )
            if timeout is not None:
                kwargs["timeout"] = timeout
                self.timeout_s = timeout.total_seconds()
            everyone = tuple(range(self.world_size))
            wanted = sorted({tuple(sorted(g)) for g in groups if len(g) > 1} | {everyone})
            for ranks in wanted:  # same order on every rank, as new_group requires
                self._groups[ranks] = dist.new_group(list(ranks), **kwargs)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def group(self, ranks: Sequence[int]) -> Any:
        key = tuple(sorted(ranks))
        if key not in self._groups:
            raise KeyError(f"no process group was created for ranks {list(key)}")
        return self._groups[key]

    # -- enqueueing ----------------------------------------------------------
    def reduce_mean(
        self, tensors: Sequence[Tensor], dst: int, callback: Callback, *, symmetric: bool = True
    ) -> None:
        """Average ``tensors`` over all ranks; ``callback(averaged)`` runs on ``dst`` only."""
        tensors = list(tensors)
        if not self.distributed:
            callback(tensors)
            return
        sym = [symmetric and self.symmetry_aware] * len(tensors)
        self._enqueue(
            ("reduce", dst, tensors[0].dtype), tensors, sym, callback if self.rank == dst else None
        )

    def broadcast(
        self,
        tensors: Sequence[Tensor],
        src: int,
        ranks: Sequence[int],
        callback: Callback | None = None,
        *,
        symmetric: Sequence[bool] | None = None,
        kind: str = "broadcast",
    ) -> None:
        """Send ``tensors`` from ``src`` to ``ranks``; receivers pass buffers of the right shape."""
        tensors = list(tensors)
        ranks = tuple(sorted(ranks))
        if not self.distributed or len(ranks) == 1 or self.rank not in ranks:
            if callback is not None and self.rank in ranks:
                callback(tensors)
            return
        sym = [bool(s) and self.symmetry_aware for s in (symmetric or [False] * len(tensors))]
        self._enqueue((kind, ranks, src, tensors[0].dtype), tensors, sym, callback)

    def allreduce_sum(self, tensor: Tensor, callback: Callback) -> None:
        if not self.distributed:
            callback([tensor])
            return
        self._enqueue(("allreduce", tensor.dtype), [tensor], [False], callback)

    def _enqueue(
        self,
        key: tuple[Any, ...],
        tensors: list[Tensor],
        symmetric: list[bool],
        cb: Callback | None,
    ) -> None:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise ValueError("tensors sent together must share a dtype")
        if self.bucket_cap_bytes == 0 and len(tensors) > 1:
            # Bucketing off: one collective per tensor; the callback still
            # receives the item's tensors together, once all have arrived.
            parts: list[Tensor | None] = [None] * len(tensors)

            def part(i: int) -> Callback | None:
                if cb is None:
                    return None

                def store(out: list[Tensor]) -> None:
                    parts[i] = out[0]
                    if all(p is not None for p in parts):
                        cb([p for p in parts if p is not None])

                return store

            for i, (t, s) in enumerate(zip(tensors, symmetric)):
                self._enqueue(key, [t], [s], part(i))
            return
        numel = sum(_packed_numel(t.shape, s) for t, s in zip(tensors, symmetric))
        bucket = self._pending.setdefault(key, _Bucket())
        if (
            bucket.items
            and (bucket.numel + numel) * tensors[0].element_size() > self.bucket_cap_bytes
        ):
            self._launch(key, self._pending.pop(key))
            bucket = self._pending.setdefault(key, _Bucket())
        bucket.items.append(_Item(tensors, symmetric, cb))
        bucket.numel += numel
        if bucket.numel * tensors[0].element_size() >= self.bucket_cap_bytes:
            self._launch(key, self._pending.pop(key))

    # -- launching -------------------------------------------------------------
    def _launch(self, key: tuple[Any, ...], bucket: _Bucket) -> None:
        kind = key[0]
        packed = [
            _pack(t, s) for item in bucket.items for t, s in zip(item.tensors, item.symmetric)
        ]
        flat = torch.cat(packed) if len(packed) > 1 else packed[0].clone()
        nbytes = flat.numel() * flat.element_size()
        world = self.group(range(self.world_size))
        finish: Callable[[Tensor], Tensor] = _identity
        if kind == "reduce":
            dst = key[1]
            work = dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=world, async_op=True)
            world_size = self.world_size
            finish = lambda x: x.div_(world_size)  # noqa: E731
            self.stats.record("factor_reduce", nbytes)
        elif kind == "allreduce":
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=world, async_op=True)
            self.stats.record("allreduce", nbytes)
        else:
            ranks, src = key[1], key[2]
            work = dist.broadcast(flat, src=src, group=self.group(ranks), async_op=True)
            self.stats.record(kind, nbytes)
        self._launched.append(_Launched(kind, work, flat, bucket.items, finish))

    def flush(self) -> None:
        """Launch every partly filled bucket."""
        for key in list(self._pending):
            self._launch(key, self._pending.pop(key))

    def wait(self) -> None:
        """Flush, complete every launched collective and run the callbacks."""
        self.flush()
        launched, self._launched = self._launched, []
        for op in launched:
            try:
                op.work.wait()
            except RuntimeError as exc:
                raise CommunicationError(
                    f"kaisa: a {op.kind} collective failed on rank {self.rank} of "
                    f"{self.world_size} (process-group timeout: {self.timeout_s or 'default'} s). "
                    "Another rank probably died or never reached this preconditioner step "
                    f"(every rank must call step() and state_dict() together). Cause: {exc}"
                ) from exc
            if not any(item.callback is not None for item in op.items):
                continue
            flat = op.finish(op.flat)
            offset = 0
            for item in op.items:
                outs = []
                for t, s in zip(item.tensors, item.symmetric):
                    n = _packed_numel(t.shape, s)
                    outs.append(_unpack(flat[offset : offset + n], t.shape, s))
                    offset += n
                if item.callback is not None:
                    item.callback(outs)


def _default_group_timeout() -> datetime.timedelta | None:
    """The timeout the user gave ``init_process_group``.

    ``new_group`` does not inherit it (it falls back to torch's 30-minute
    default), so read it from the default group's backend; None if this
    (private) attribute is unavailable in a future torch.
    """
    try:
        group = dist.distributed_c10d._get_default_group()
    except (RuntimeError, ValueError):
        return None
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def _identity(x: Tensor) -> Tensor:
    return x
