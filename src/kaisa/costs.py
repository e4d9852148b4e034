"""The cost model the planner predicts with: decompositions, products, links.

A K-FAC step's extra work is a handful of kernels whose cost follows from
the layer sizes: an ``n×n`` eigendecomposition or Cholesky inverse (``c·n³``
plus a fixed launch cost), dense matrix products at some FLOP rate, and
collectives over a link with a bandwidth and a latency.  :class:`CostModel`
holds those few numbers; :func:`measure_costs` times them on a device, so a
plan made for a GPU cluster can use figures measured on one of its GPUs
(``kaisa plan --measure-costs`` writes them as JSON).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CostModel", "measure_costs"]


@dataclass(frozen=True)
class CostModel:
    """Seconds per kernel and per byte; every field is a plain number (JSON).

    Attributes:
        eigh_n3: seconds per n³ of a symmetric eigendecomposition.
        eigh_fixed: seconds every eigendecomposition costs whatever its size.
        inverse_n3, inverse_fixed: the same for a damped Cholesky inverse.
        flops: dense matrix-product rate (FLOP/s) for Grams and preconditioning.
        memory_bandwidth: bytes/s of a large device-memory copy: building a
            factor's rows (a conv's unfolded patches) is bound by it.
        bandwidth: bytes per second a rank moves over the data-parallel link.
        latency: seconds per collective hop.
        device: where the kernel figures were measured (or "given").
    """

    eigh_n3: float = 2e-10
    eigh_fixed: float = 1e-4
    inverse_n3: float = 5e-11
    inverse_fixed: float = 5e-5
    flops: float = 1e11
    memory_bandwidth: float = 1e10
    bandwidth: float = 1e9
    latency: float = 5e-5
    device: str = "given"

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "device" and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"cost model field {name} must be a number >= 0; got {value!r}")
        for name in ("flops", "bandwidth", "memory_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cost model field {name} must be > 0")

    def decompose(self, n: int, method: str, dense: bool = True) -> float:
        """Seconds to decompose one factor of size ``n``; a diagonal is elementwise."""
        if not dense:
            return n / self.flops
        if method == "eigen":
            return self.eigh_n3 * n**3 + self.eigh_fixed
        return self.inverse_n3 * n**3 + self.inverse_fixed

    def compute(self, flop: float) -> float:
        return flop / self.flops

    def traffic(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through device memory."""
        return nbytes / self.memory_bandwidth

    def collective(self, nbytes: int, ranks: int, calls: int, allreduce: bool = False) -> float:
        """Tree/ring estimate: ``calls·latency·⌈log2 p⌉ + (2 if all-reduce)·bytes/bandwidth``."""
        if ranks <= 1 or nbytes == 0:
            return 0.0
        hops = math.ceil(math.log2(ranks))
        return calls * self.latency * hops + (2 if allreduce else 1) * nbytes / self.bandwidth

    def with_link(self, bandwidth: float | None, latency: float | None) -> CostModel:
        fields = asdict(self)
        if bandwidth is not None:
            fields["bandwidth"] = bandwidth
        if latency is not None:
            fields["latency"] = latency
        return CostModel(**fields)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CostModel:
        data: dict[str, Any] = json.loads(Path(path).read_text())
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"cost model {path} has unknown fields {sorted(unknown)}")
        return cls(**data)


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
    """Time eigh, Cholesky inverse and a matrix product on ``device``.

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
        memory_bandwidth=2 * big.numel() * big.element_size() / copy,
        bandwidth=bandwidth if bandwidth is not None else defaults.bandwidth,
        latency=latency if latency is not None else defaults.latency,
        device=f"{name} ({torch.get_num_threads()} threads)" if device.type == "cpu" else name,
    )
