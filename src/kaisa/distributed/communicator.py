"""The step's collectives (every ``torch.distributed`` call kaisa makes lives in
:mod:`kaisa.distributed`: here, and the engines' in
:mod:`~kaisa.distributed.collectives`).

:class:`Communicator` works on one data-parallel group (from a
:class:`~kaisa.distributed.topology.Topology`; the world by default).  Ranks it is given
and reports are *positions in that group*, as in the work plan; it maps them
to global ranks itself.  It creates its process groups once (a private copy
of the data-parallel group, so K-FAC traffic never interleaves with DDP's
gradient buckets, plus one group per worker group and per receiver group of
the work plan) and offers:

* :meth:`Communicator.reduce_sum` — a flat buffer summed *onto one owner*
  (the factor reduction of :mod:`kaisa.step.reduce` lays out its buckets);
* :meth:`Communicator.broadcast` — bucketed, from a source rank to a group
  (eigenbases to gradient workers, preconditioned gradients to receivers);
* :meth:`Communicator.allreduce_sum` — small vectors (row counts, traces);
* :meth:`Communicator.agree_all` — which of a few flags hold on every rank;
* :meth:`Communicator.sum_model_parallel` — the KL clip's inner product over
  the tensor- and pipeline-parallel groups.

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

from kaisa.distributed.collectives import group_ranks
from kaisa.distributed.messages import MessagePart, Part, message_numel, packed_numel
from kaisa.distributed.topology import Topology

__all__ = [
    "CommStats",
    "CommunicationError",
    "Communicator",
    "MessagePart",
    "Part",
    "group_ranks",
    "message_numel",
    "pack",
    "packed_numel",
    "unpack",
]

Callback = Callable[[list[Tensor]], None]


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
        if self.current:  # a step without traffic (every step of one process) makes nothing
            self.step = {k: dict(v) for k, v in self.current.items()}
            self.current = defaultdict(_zero)
        elif self.step:
            self.step = {}

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        return {
            "step": {k: dict(v) for k, v in self.step.items()},
            "total": {k: dict(v) for k, v in self.total.items()},
        }


def _zero() -> dict[str, int]:
    return {"calls": 0, "bytes": 0}


def pack(t: Tensor, symmetric: bool) -> Tensor:
    if symmetric:
        n = t.shape[0]
        idx = torch.triu_indices(n, n, device=t.device)
        return t[idx[0], idx[1]]
    return t.reshape(-1)


def unpack(flat: Tensor, shape: torch.Size, symmetric: bool) -> Tensor:
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


class Communicator:
    """Bucketed asynchronous collectives over the groups of one work plan.

    Args:
        topology: the data-parallel group and the model-parallel groups.
        grad_workers: m, the gradient workers per layer of the plan (0: all
            ranks): with n = W/m, the receiver groups are blocks of n
            consecutive positions, the worker groups the positions equal
            modulo n.
        device_type: the device of the tensors sent (for the DeviceMesh).
        bucket_cap_mb: bucket size; 0 sends each tensor on its own.
        symmetry_aware: send only the upper triangle of symmetric matrices.
        timeout_s: timeout of the groups created here (None: the default's).
    """

    def __init__(
        self,
        topology: Topology | None = None,
        grad_workers: int = 0,
        *,
        device_type: str = "cpu",
        bucket_cap_mb: float = 25.0,
        symmetry_aware: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        topology = topology or Topology()
        self.topology = topology
        self.global_ranks = group_ranks(topology.dp)
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if me not in self.global_ranks:
            raise ValueError(f"topology.dp does not contain this process (global rank {me})")
        self.rank = self.global_ranks.index(me)
        self.world_size = len(self.global_ranks)
        self.model_parallel = tuple(g for g in topology.model_parallel if g.size() > 1)
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.symmetry_aware = symmetry_aware
        self.timeout_s = timeout_s
        self.stats = CommStats()
        #: kaisa's ``("kfac_workers", "kfac_receivers")`` DeviceMesh (None
        #: where it has no group to give: one process, or f = 1 or 1/W on
        #: the whole world, or a bare data-parallel subgroup without a mesh)
        self.mesh: Any = None
        self._groups: dict[tuple[int, ...], Any] = {}
        self._pending: dict[tuple[Any, ...], _Bucket] = {}
        self._launched: list[_Launched] = []
        if self.world_size > 1:
            timeout = (
                datetime.timedelta(seconds=timeout_s)
                if timeout_s is not None
                else _default_group_timeout()
            )
            if timeout is not None:
                self.timeout_s = timeout.total_seconds()
            self.mesh = _make_groups(self, grad_workers or self.world_size, timeout, device_type)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def group(self, ranks: Sequence[int]) -> Any:
        """The process group of this rank's data-parallel group, worker group or
        receiver group (positions in the data-parallel group)."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            raise KeyError(f"no process group was created for ranks {list(key)}")
        return self._groups[key]

    def _error(self, kind: str, exc: Exception) -> CommunicationError:
        return CommunicationError(
            f"kaisa: a {kind} collective failed on rank {self.rank} of the {self.world_size}-rank "
            f"data-parallel group (process-group timeout: {self.timeout_s or 'default'} s). "
            "Another rank probably died or never reached this preconditioner step "
            f"(every rank must call step() and state_dict() together). Cause: {exc}"
        )

    # -- enqueueing ----------------------------------------------------------
    def reduce_sum(
        self, flat: Tensor, dst: int, callback: Callback | None, *, kind: str = "factor_reduce"
    ) -> None:
        """Sum ``flat`` over the group onto ``dst`` now; ``callback([sum])`` runs there.

        The caller lays the buffer out (the same on every rank); it is sent
        as is, so that the order of these calls alone must match across ranks.
        """
        if not self.distributed:
            if callback is not None:
                callback([flat])
            return
        item = _Item([flat], [False], callback if self.rank == dst else None)
        work = dist.reduce(
            flat,
            dst=self.global_ranks[dst],
            op=dist.ReduceOp.SUM,
            group=self.group(range(self.world_size)),
            async_op=True,
        )
        self.stats.record(kind, flat.numel() * flat.element_size())
        self._launched.append(_Launched(kind, work, flat, [item]))

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

    def allreduce_sum(self, tensor: Tensor, callback: Callback, *, kind: str = "allreduce") -> None:
        if not self.distributed:
            callback([tensor])
            return
        self._enqueue(("allreduce", kind, tensor.dtype), [tensor], [False], callback)

    def agree_all(self, flags: list[bool], device: torch.device) -> list[bool]:
        """``flags[i]`` and-ed over the group: blocking, one small collective."""
        if not self.distributed or not flags:
            return flags
        t = torch.tensor(flags, dtype=torch.int32, device=device)
        self._run(
            "agree",
            dist.all_reduce(
                t, op=dist.ReduceOp.MIN, group=self.group(range(self.world_size)), async_op=True
            ),
        )
        self.stats.record("agree", t.numel() * t.element_size())
        return [bool(v) for v in t.tolist()]

    def all_present(self, key: str, timeout_s: float) -> bool:
        """Whether every rank of the group reaches this call (named ``key``,
        the same on every rank) within ``timeout_s``; the same answer on every
        rank that calls, latecomers included.

        Uses the rendezvous store, not a collective, so a call made on some
        ranks only (kfac-pytorch's ``state_dict()`` on rank 0) never leaves a
        collective half-run: the ranks present wait ``timeout_s``, agree
        (an atomic compare-and-set) that the round is partial, and go on.
        True where there is no store to ask (the caller then runs its
        collective as before).
        """
        store = self._store() if self.distributed else None
        if store is None:
            return True
        base = self._store_key(key)
        if store.add(f"{base}/arrived", 1) == self.world_size:
            store.set(f"{base}/all", "1")
        try:
            store.wait([f"{base}/all"], datetime.timedelta(seconds=timeout_s))
            wanted = "go"
        except (RuntimeError, dist.DistStoreError):
            wanted = "partial"
        # the first to decide sets the verdict; everyone reads the same one
        return bytes(store.compare_set(f"{base}/verdict", "", wanted)) == b"go"

    def _store(self) -> Any:
        try:
            return dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            return None

    def publish(self, key: str, value: str) -> None:
        """Write ``key`` in the rendezvous store (for this group), without a collective."""
        store = self._store()
        if store is not None:
            store.set(self._store_key(key), value)

    def published(self, key: str) -> str | None:
        """What :meth:`publish` wrote under ``key``, or None (one store round trip)."""
        store = self._store()
        full = self._store_key(key)
        if store is None or not store.check([full]):
            return None
        return bytes(store.get(full)).decode()

    def _store_key(self, key: str) -> str:
        return f"kaisa/{key}/{','.join(map(str, self.global_ranks))}"

    def agree_model_parallel(self, flag: bool, device: torch.device) -> bool:
        """``flag`` and-ed over the tensor- and pipeline-parallel groups (blocking;
        nothing to do without them)."""
        if not self.model_parallel:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        for group in self.model_parallel:
            self._run("agree", dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True))
            self.stats.record("agree", t.numel() * t.element_size())
        return bool(t.item())

    def sum_model_parallel(self, value: Tensor) -> Tensor:
        """``value`` summed over the tensor- and pipeline-parallel groups (in place)."""
        for group in self.model_parallel:
            self._run("model_parallel", dist.all_reduce(value, group=group, async_op=True))
            self.stats.record("model_parallel", value.numel() * value.element_size())
        return value

    def _run(self, kind: str, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise self._error(kind, exc) from exc

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
        numel = sum(packed_numel(t.shape, s) for t, s in zip(tensors, symmetric))
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
        packed = [pack(t, s) for item in bucket.items for t, s in zip(item.tensors, item.symmetric)]
        flat = torch.cat(packed) if len(packed) > 1 else packed[0].clone()
        nbytes = flat.numel() * flat.element_size()
        if kind == "allreduce":
            kind = key[1]
            world = self.group(range(self.world_size))
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=world, async_op=True)
        else:
            ranks, src = key[1], key[2]
            work = dist.broadcast(
                flat, src=self.global_ranks[src], group=self.group(ranks), async_op=True
            )
        self.stats.record(kind, nbytes)
        self._launched.append(_Launched(kind, work, flat, bucket.items))

    def flush(self) -> None:
        """Launch every partly filled bucket."""
        for key in list(self._pending):
            self._launch(key, self._pending.pop(key))

    def wait(self) -> None:
        """Flush, complete every launched collective and run the callbacks."""
        self.flush()
        launched, self._launched = self._launched, []
        for op in launched:
            self._run(op.kind, op.work)
            if not any(item.callback is not None for item in op.items):
                continue
            flat = op.flat
            offset = 0
            for item in op.items:
                outs = []
                for t, s in zip(item.tensors, item.symmetric):
                    n = packed_numel(t.shape, s)
                    outs.append(unpack(flat[offset : offset + n], t.shape, s))
                    offset += n
                if item.callback is not None:
                    item.callback(outs)


def _make_groups(
    comm: Communicator, m: int, timeout: datetime.timedelta | None, device_type: str
) -> Any:
    """A private copy of the data-parallel group (K-FAC traffic never
    interleaves with DDP's buckets), and this rank's worker group (the
    positions ≡ rank mod n, n = W/m) and receiver group (its block of n
    consecutive positions): the two dimensions of the plan's ``(m, n)``
    rank grid, a mesh unflattened from the data-parallel one, created by
    torch's DeviceMesh (one ``split_group`` per dimension on NCCL) rather
    than one ``new_group`` per group of the plan."""
    w, mesh = comm.world_size, None
    if w % m:
        raise ValueError(f"{m} gradient workers do not divide the world size {w}")
    subgroup = w < dist.get_world_size()
    everyone = tuple(range(w))
    comm._groups[everyone] = dist.new_group(
        list(comm.global_ranks),
        timeout=timeout,
        use_local_synchronization=subgroup,  # only this group's members call it
    )
    n = w // m  # the m × n rank grid of the plan: workers a column, receivers a row
    workers = tuple(range(comm.rank % n, w, n))
    receivers = tuple(range(comm.rank - comm.rank % n, comm.rank - comm.rank % n + n))
    dp_mesh = comm.topology.dp_mesh
    if dp_mesh is None and not subgroup:
        if 1 < m < w:  # f = 1 and 1/W need no group beside `everyone`
            dp_mesh = _mesh_of(device_type, comm.global_ranks)
    elif dp_mesh is not None and subgroup:
        # the unflatten creates the groups of every data-parallel group of
        # the job's mesh at once: every rank must ask for the same shape
        _check_same_workers(comm, m, device_type)
    if dp_mesh is not None:
        mesh = dp_mesh._unflatten(
            0,
            (m, n),
            ("kfac_workers", "kfac_receivers"),
            backend_override=_timeouts(dp_mesh.get_group(), timeout),
        )
        found = {
            workers: mesh.get_group("kfac_workers"),
            receivers: mesh.get_group("kfac_receivers"),
        }
    elif subgroup:  # a bare subgroup: members create their own two groups
        found = {
            ranks: dist.new_group(
                [comm.global_ranks[r] for r in ranks],
                timeout=timeout,
                use_local_synchronization=True,
            )
            for ranks in (workers, receivers)
            if 1 < len(ranks) < w
        }
    else:
        found = {}
    for ranks, group in found.items():
        if 1 < len(ranks) < w:  # a singleton needs none; the whole group is `everyone`
            comm._groups[ranks] = group
    return mesh


def _check_same_workers(comm: Communicator, m: int, device_type: str) -> None:
    """Refuse, rather than hang, when ranks of one job mesh ask for different
    numbers of gradient workers (their DeviceMesh calls would not match)."""
    t = torch.tensor([m, -m], dtype=torch.int64, device=torch.device(device_type))
    comm._run("agree", dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True))
    if int(t[0]) != -int(t[1]):
        raise ValueError(
            "grad_worker_fraction must give the same number of gradient workers on every "
            f"rank of the DeviceMesh: this rank has {m}, others between {-int(t[1])} and "
            f"{int(t[0])} (kaisa's worker and receiver groups are dimensions of one mesh)"
        )


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


def _mesh_of(device_type: str, ranks: Sequence[int]) -> Any:
    """A one-dimensional DeviceMesh over the whole world (in ``ranks``' order);
    its own dimension reuses the default group, so it creates none."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.tensor(list(ranks)), mesh_dim_names=("kfac_dp",))


def _timeouts(group: Any, timeout: datetime.timedelta | None) -> dict[str, Any] | None:
    """``backend_override`` giving the mesh's new groups kaisa's timeout (a
    DeviceMesh otherwise creates them with torch's 30-minute default)."""
    if timeout is None:
        return None
    backend = dist.get_backend(group)
    options: Any
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    elif backend == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
    else:  # a mixed or custom backend: torch's own default
        return None
    options._timeout = timeout
    return {"kfac_workers": options, "kfac_receivers": options}
