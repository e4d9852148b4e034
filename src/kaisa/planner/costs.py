"""The cost model the planner predicts with: decompositions, products, links.

A K-FAC step's extra work is a handful of kernels whose cost follows from
the layer sizes: an ``n×n`` eigendecomposition or Cholesky inverse (``c·n³``
plus a fixed launch cost), dense matrix products at some FLOP rate, and
collectives over a link with a bandwidth and a latency.  :class:`CostModel`
holds those few numbers; :func:`measure_costs` times them on a device, so a
plan made for a GPU cluster can use figures measured on one of its GPUs
(``kaisa plan --measure-costs`` writes them as JSON).

Links come in one level (every collective at ``bandwidth``, the default) or
two, when ``ranks_per_node`` is given: consecutive data-parallel ranks share
a node, a collective whose ranks stay inside one node runs at
``intra_bandwidth``, and one that spans nodes pays an intra-node stage and an
inter-node stage among the nodes (:meth:`CostModel.collective`).  KAISA's
grid puts the per-step gradient broadcast inside a node and the inverse
broadcast across nodes, so which fraction is cheapest depends on this.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["KERNELS", "CostModel", "Placement", "measure_costs", "placement"]

#: the decomposition kernels the cost model has figures for
KERNELS = ("eigh", "inverse")


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks sit: how many, on how many nodes, how many per node.

    ``most_per_node`` sets the depth of the intra-node stage; ``least_per_node``
    the share of a node's network link the group holds (the bottleneck node).
    """

    ranks: int
    nodes: int
    most_per_node: int
    least_per_node: int


@functools.lru_cache(maxsize=4096)
def _place_range(ranks: range, ranks_per_node: int) -> Placement:
    if len(ranks) == 0:
        return Placement(0, 0, 0, 0)
    if abs(ranks.step) >= ranks_per_node:  # every member on its own node
        return Placement(len(ranks), len(ranks), 1, 1)
    _, counts = np.unique(np.asarray(ranks) // ranks_per_node, return_counts=True)
    return Placement(len(ranks), len(counts), int(counts.max()), int(counts.min()))


def placement(ranks: int | Sequence[int], ranks_per_node: int | None) -> Placement:
    """The placement of a group given as its data-parallel ranks (an int p
    means ranks 0 … p−1).  Rank r is on node ``r // ranks_per_node``:
    consecutive ranks share a node, as launchers number them; ``None`` puts
    every rank on its own node (one level)."""
    group = range(ranks) if isinstance(ranks, int) else ranks
    if not isinstance(group, range):  # an even stride is a range: cached
        members = sorted(set(group))
        step = members[1] - members[0] if len(members) > 1 else 1
        if not members:
            group = range(0)
        elif members == list(range(members[0], members[-1] + 1, step)):
            group = range(members[0], members[-1] + 1, step)
        else:
            group = members
    if ranks_per_node is None:
        return Placement(len(group), len(group), 1, 1)
    if isinstance(group, range):
        return _place_range(group, ranks_per_node)
    _, counts = np.unique(np.asarray(group) // ranks_per_node, return_counts=True)
    return Placement(len(group), len(counts), int(counts.max()), int(counts.min()))


@dataclass(frozen=True)
class CostModel:
    """Seconds per kernel and per byte; every field is a plain number (JSON).

    Attributes:
        eigh_n3: seconds per n³ of a symmetric eigendecomposition.
        eigh_fixed: seconds every eigendecomposition costs whatever its size.
        inverse_n3, inverse_fixed: the same for a damped Cholesky inverse.
        flops: dense matrix-product rate (FLOP/s) for Grams and preconditioning.
        bf16_flops: the same in bfloat16, for the products ``factor_compute_dtype``
            and ``precondition_dtype`` put there (tensor cores, AMX or AVX-512
            BF16 run them faster; elsewhere slower).  None: ``flops``.
        memory_bandwidth: bytes/s of a large device-memory copy: building a
            factor's rows (a conv's unfolded patches) is bound by it.
        bandwidth: bytes per second a rank moves over the data-parallel link;
            with ``ranks_per_node``, between nodes: a node's network link
            divided by its ranks (a 100 Gb/s NIC shared by 4 GPUs: 25 Gb/s).
        latency: seconds per collective hop (between nodes, two levels).
        device: where the kernel figures were measured (or "given").
        ranks_per_node: None: one level, every collective at ``bandwidth``.
            Else ranks ``r`` and ``s`` share a node when ``r // ranks_per_node
            == s // ranks_per_node`` (consecutive ranks, as launchers number them).
        intra_bandwidth: bytes per second a rank moves inside a node (NVLink);
            required when ``ranks_per_node`` > 1, ignored in one level.
        intra_latency: seconds per hop inside a node (None: ``latency``).
    """

    eigh_n3: float = 2e-10
    eigh_fixed: float = 1e-4
    inverse_n3: float = 5e-11
    inverse_fixed: float = 5e-5
    flops: float = 1e11
    bf16_flops: float | None = None
    memory_bandwidth: float = 1e10
    bandwidth: float = 1e9
    latency: float = 5e-5
    device: str = "given"
    ranks_per_node: int | None = None
    intra_bandwidth: float | None = None
    intra_latency: float | None = None

    def __post_init__(self) -> None:
        optional = ("ranks_per_node", "intra_bandwidth", "intra_latency", "bf16_flops")
        for name, value in asdict(self).items():
            if name == "device" or (name in optional and value is None):
                continue
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"cost model field {name} must be a number >= 0; got {value!r}")
        for name in ("flops", "bf16_flops", "bandwidth", "memory_bandwidth", "intra_bandwidth"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"cost model field {name} must be > 0")
        rpn = self.ranks_per_node
        if rpn is not None and (not isinstance(rpn, int) or rpn < 1):
            raise ValueError(f"cost model field ranks_per_node must be an int >= 1; got {rpn!r}")
        if rpn is not None and rpn > 1 and self.intra_bandwidth is None:
            raise ValueError(
                f"ranks_per_node={rpn} needs intra_bandwidth (bytes/s per rank inside "
                "a node; kaisa plan --intra-node-bandwidth-gbps)"
            )

    def decompose(self, n: int, kernel: str, dense: bool = True) -> float:
        """Seconds to decompose one factor of size ``n`` with ``kernel`` — what
        a curvature method declares (:attr:`CurvatureMethod.kernel`):
        ``"eigh"`` (an eigendecomposition) or ``"inverse"`` (a damped
        Cholesky inverse); a diagonal factor is elementwise."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
        if not dense:
            return n / self.flops
        if kernel == "eigh":
            return self.eigh_n3 * n**3 + self.eigh_fixed
        return self.inverse_n3 * n**3 + self.inverse_fixed

    def compute(self, flop: float, dtype: torch.dtype | None = None) -> float:
        """Seconds for ``flop`` of dense matrix products in ``dtype`` (None:
        the factors' float32/float64, at ``flops``)."""
        if dtype == torch.bfloat16 and self.bf16_flops is not None:
            return flop / self.bf16_flops
        return flop / self.flops

    def traffic(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through device memory."""
        return nbytes / self.memory_bandwidth

    def collective(
        self,
        nbytes: float,
        ranks: int | Sequence[int],
        calls: int,
        allreduce: bool = False,
    ) -> float:
        """Seconds for ``calls`` collectives moving ``nbytes`` in all over the
        group ``ranks`` (data-parallel positions; an int p: ranks 0 … p−1).

        One level: ``calls·latency·⌈log2 p⌉ + v/bandwidth``, where ``v`` is the
        bytes, twice them for an all-reduce.  Two levels (``ranks_per_node``):
        a group inside one node costs ``calls·intra_latency·⌈log2 p⌉ +
        v/intra_bandwidth``; a group on k > 1 nodes, with at most ``l`` and at
        least ``s`` of its ranks on a node, adds the intra-node stage (when
        ``l`` > 1) to an inter-node stage ``calls·latency·⌈log2 k⌉ +
        v/(s·bandwidth)``: a hierarchical (or ring) collective carries the
        bytes across each node's link once, not once per rank, and the group
        holds ``s`` ranks' shares of the slowest node's link (the other
        groups running at the same time hold the rest).  Stages are added, not
        overlapped.  ``ranks_per_node=1`` gives the one-level cost.
        """
        if nbytes == 0:
            return 0.0
        group = placement(ranks, self.ranks_per_node)
        if group.ranks <= 1:
            return 0.0
        volume = (2 if allreduce else 1) * nbytes
        if self.ranks_per_node is None:
            return calls * self.latency * _hops(group.ranks) + volume / self.bandwidth
        seconds = 0.0
        if group.most_per_node > 1:
            assert self.intra_bandwidth is not None  # checked in __post_init__
            latency = self.latency if self.intra_latency is None else self.intra_latency
            seconds += calls * latency * _hops(group.most_per_node)
            seconds += volume / self.intra_bandwidth
        if group.nodes > 1:
            seconds += calls * self.latency * _hops(group.nodes)
            seconds += volume / (group.least_per_node * self.bandwidth)
        return seconds

    def with_link(
        self,
        bandwidth: float | None = None,
        latency: float | None = None,
        *,
        ranks_per_node: int | None = None,
        intra_bandwidth: float | None = None,
        intra_latency: float | None = None,
    ) -> CostModel:
        """This model with the link figures that are given (None: kept)."""
        given: dict[str, Any] = {
            "bandwidth": bandwidth,
            "latency": latency,
            "ranks_per_node": ranks_per_node,
            "intra_bandwidth": intra_bandwidth,
            "intra_latency": intra_latency,
        }
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def describe_links(self) -> str:
        """The link figures in the units links are rated in (Gb/s, µs)."""
        inter = f"{self.bandwidth * 8 / 1e9:g} Gb/s per rank, {self.latency * 1e6:g} µs per hop"
        if self.ranks_per_node is None:
            return f"one level: {inter}"
        intra_latency = self.latency if self.intra_latency is None else self.intra_latency
        intra = (
            f"{self.intra_bandwidth * 8 / 1e9:g} Gb/s per rank, {intra_latency * 1e6:g} µs per hop"
            if self.intra_bandwidth is not None
            else "-"
        )
        return f"{self.ranks_per_node} ranks per node: inside {intra}; between nodes {inter}"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CostModel:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"cost model {path} has unknown fields {sorted(unknown)}")
        return cls(**data)


def _hops(ranks: int) -> int:
    """Depth of a binomial tree over ``ranks``: the latency a collective pays."""
    return math.ceil(math.log2(ranks))


def _best_of(fn: Any, sync: Any, repeats: int, clock: Callable[[], float]) -> float:
    fn()
    sync()
    best = math.inf
    for _ in range(repeats):
        start = clock()
        fn()
        sync()
        best = min(best, clock() - start)
    return best


def _fit_cubic(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least squares ``t = c·n³ + b`` with both terms kept non-negative."""
    x = torch.tensor([float(n) ** 3 for n in sizes], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([x, torch.ones_like(x)], 1)
    c, b = torch.linalg.lstsq(design, y.unsqueeze(1)).solution.squeeze(1).tolist()
    if b < 0 or c <= 0:  # fall back to the largest size alone
        return seconds[-1] / sizes[-1] ** 3, 0.0
    return c, b


def measure_costs(
    device: torch.device | str = "cpu",
    sizes: tuple[int, ...] = (128, 256, 512, 1024),
    dtype: torch.dtype = torch.float32,
    repeats: int = 3,
    bandwidth: float | None = None,
    latency: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Time eigh, Cholesky inverse and a matrix product on ``device`` (in
    ``dtype`` and in bfloat16).

    Link figures cannot be measured from one process; they are taken as
    given (defaults: 1 GB/s and 50 µs, a CPU gloo link; pass a cluster's).
    ``clock``: wall time by default; ``time.process_time`` on a CPU shared
    with other jobs times only this process's work (with one thread, what
    an idle core would take), the clock the step it predicts is timed with.
    """
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    eigh, inverse = [], []
    for n in sizes:
        x = torch.randn(n, 2 * n, generator=gen, dtype=torch.float64)
        spd = (x @ x.T / (2 * n) + 1e-3 * torch.eye(n, dtype=torch.float64)).to(device, dtype)
        eigh.append(_best_of(lambda spd=spd: torch.linalg.eigh(spd), sync, repeats, clock))
        inverse.append(
            _best_of(
                lambda spd=spd: torch.cholesky_inverse(torch.linalg.cholesky(spd)),
                sync,
                repeats,
                clock,
            )
        )
    n = max(sizes)
    a = torch.randn(n, n, generator=gen).to(device, dtype)
    product = _best_of(lambda: a @ a, sync, repeats, clock)
    half = a.to(torch.bfloat16)
    product_bf16 = _best_of(lambda: half @ half, sync, repeats, clock)
    big = torch.empty(2**24, dtype=torch.float32, device=device)  # 64 MiB
    copy = _best_of(lambda: big.clone(), sync, repeats, clock)
    eigh_n3, eigh_fixed = _fit_cubic(list(sizes), eigh)
    inverse_n3, inverse_fixed = _fit_cubic(list(sizes), inverse)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    defaults = CostModel()
    return CostModel(
        eigh_n3=eigh_n3,
        eigh_fixed=eigh_fixed,
        inverse_n3=inverse_n3,
        inverse_fixed=inverse_fixed,
        flops=2 * n**3 / product,
        bf16_flops=2 * n**3 / product_bf16,
        memory_bandwidth=2 * big.numel() * big.element_size() / copy,
        bandwidth=bandwidth if bandwidth is not None else defaults.bandwidth,
        latency=latency if latency is not None else defaults.latency,
        device=f"{name} ({torch.get_num_threads()} threads)" if device.type == "cpu" else name,
    )
