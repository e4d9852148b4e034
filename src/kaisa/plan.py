"""The KAISA work plan: a pure function from layer sizes to who does what.

Given the factor sizes of every layer, the world size W and the gradient
worker fraction f, :func:`make_plan` decides

* which rank decomposes each factor (greedy longest-processing-time balance
  by cost n³ for ``'compute'`` or n² for ``'memory'``);
* which ranks are each layer's *gradient workers* — they hold its
  eigenbases (or inverses) and compute its preconditioned gradient;
* which ranks receive the preconditioned gradient from which worker.

The ranks are split into W/m *worker groups* of m = f·W consecutive ranks,
and into m *receiver groups* ``{i, i+m, i+2m, …}``.  A layer is given to one
worker group; its decomposer(s) sit in that group and broadcast the
second-order tensors to the group on inverse-update steps; each worker then
broadcasts the preconditioned gradient to the receiver group it belongs to,
every step.  f = 1 (COMM-OPT) makes every rank a worker of every layer and
removes the per-step broadcast; f = 1/W (MEM-OPT) makes one worker per layer.

Nothing here touches ``torch.distributed``: the plan is immutable, printable
(:meth:`WorkPlan.describe`) and unit-testable without processes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kaisa.config import AssignmentStrategy, DistributedStrategy

__all__ = [
    "LayerPlan",
    "LayerSpec",
    "WorkPlan",
    "allowed_fractions",
    "grad_workers_for",
    "make_plan",
]


@dataclass(frozen=True)
class LayerSpec:
    """What the planner needs to know of a layer."""

    name: str
    a_dim: int
    g_dim: int


@dataclass(frozen=True)
class LayerPlan:
    """Who does what for one layer (all ranks are global ranks)."""

    name: str
    a_dim: int
    g_dim: int
    a_decomposer: int
    g_decomposer: int
    grad_workers: tuple[int, ...]
    #: one group per gradient worker: the worker first, then the ranks it
    #: sends the preconditioned gradient to (itself included, as in a broadcast)
    receiver_groups: tuple[tuple[int, ...], ...]

    @property
    def colocated(self) -> bool:
        return self.a_decomposer == self.g_decomposer

    def is_decomposer(self, rank: int) -> bool:
        return rank in (self.a_decomposer, self.g_decomposer)

    def is_grad_worker(self, rank: int) -> bool:
        return rank in self.grad_workers

    def gradient_source(self, rank: int) -> int:
        """The gradient worker whose preconditioned gradient ``rank`` uses."""
        for group in self.receiver_groups:
            if rank in group:
                return group[0]
        raise ValueError(f"rank {rank} is in no receiver group of layer {self.name!r}")

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        for group in self.receiver_groups:
            if rank in group:
                return group
        raise ValueError(f"rank {rank} is in no receiver group of layer {self.name!r}")


def allowed_fractions(world_size: int) -> list[float]:
    """Gradient worker fractions that give equal groups: m/W for m dividing W."""
    return [m / world_size for m in range(1, world_size + 1) if world_size % m == 0]


def grad_workers_for(fraction: float | DistributedStrategy, world_size: int) -> int:
    """m, the number of gradient workers per layer, for fraction f and world W.

    Raises ``ValueError`` naming W and the allowed fractions when f·W is not a
    divisor of W.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if isinstance(fraction, DistributedStrategy):
        fraction = {
            DistributedStrategy.COMM_OPT: 1.0,
            DistributedStrategy.HYBRID_OPT: 0.5,
            DistributedStrategy.MEM_OPT: 1.0 / world_size,
        }[fraction]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise TypeError(
            f"grad_worker_fraction must be a float or DistributedStrategy; got {fraction!r}"
        )
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in [0, 1]; got {fraction}")
    if world_size == 1:
        return 1
    if fraction == 0.0:
        return 1
    workers = fraction * world_size
    m = round(workers)
    if m < 1 or not math.isclose(workers, m, rel_tol=0, abs_tol=1e-6) or world_size % m:
        allowed = ", ".join(f"{f:g}" for f in allowed_fractions(world_size))
        raise ValueError(
            f"grad_worker_fraction={fraction:g} gives {workers:g} gradient workers per layer at "
            f"world size {world_size}; it must give a divisor of the world size. "
            f"Allowed fractions at world size {world_size}: {allowed} (or 0 for 1/{world_size})"
        )
    return m


def _cost(dim: int, strategy: AssignmentStrategy) -> float:
    return float(dim) ** (3 if strategy is AssignmentStrategy.COMPUTE else 2)


@dataclass(frozen=True)
class WorkPlan:
    """The immutable assignment of K-FAC work to ranks."""

    world_size: int
    grad_workers: int
    assignment_strategy: AssignmentStrategy
    colocate_factors: bool
    layers: tuple[LayerPlan, ...]

    @property
    def worker_groups(self) -> tuple[tuple[int, ...], ...]:
        m = self.grad_workers
        return tuple(tuple(range(s, s + m)) for s in range(0, self.world_size, m))

    @property
    def receiver_groups(self) -> tuple[tuple[int, ...], ...]:
        m = self.grad_workers
        return tuple(tuple(range(i, self.world_size, m)) for i in range(m))

    @property
    def grad_worker_fraction(self) -> float:
        return self.grad_workers / self.world_size

    @functools.cached_property
    def _by_name(self) -> dict[str, LayerPlan]:
        return {lp.name: lp for lp in self.layers}

    def layer(self, name: str) -> LayerPlan:
        """The plan of one layer (O(1): it is looked up for every layer every step)."""
        return self._by_name[name]

    def rank_load(self, rank: int) -> dict[str, float]:
        """Per-rank work and memory in element counts (not bytes)."""
        decomposition_cost = 0.0
        factor_elems = 0
        second_order_elems = 0
        precondition_flops = 0.0
        for lp in self.layers:
            if lp.a_decomposer == rank:
                decomposition_cost += _cost(lp.a_dim, self.assignment_strategy)
                factor_elems += lp.a_dim**2
            if lp.g_decomposer == rank:
                decomposition_cost += _cost(lp.g_dim, self.assignment_strategy)
                factor_elems += lp.g_dim**2
            if lp.is_grad_worker(rank):
                second_order_elems += lp.a_dim**2 + lp.g_dim**2 + lp.a_dim * lp.g_dim
                precondition_flops += 4.0 * lp.a_dim * lp.g_dim * (lp.a_dim + lp.g_dim)
        return {
            "decomposition_cost": decomposition_cost,
            "factor_elements": float(factor_elems),
            "second_order_elements": float(second_order_elems),
            "precondition_flops": precondition_flops,
        }

    def describe(self) -> str:
        """A readable table of the plan: groups, per-rank load, per-layer owners."""
        lines = [
            f"WorkPlan: world_size={self.world_size}, grad_workers={self.grad_workers} "
            f"(fraction {self.grad_worker_fraction:g}), "
            f"assignment={self.assignment_strategy.value}, "
            f"colocate_factors={self.colocate_factors}",
            f"  worker groups:   {list(map(list, self.worker_groups))}",
            f"  receiver groups: {list(map(list, self.receiver_groups))}",
            f"  {'rank':>4} {'decomp cost':>14} {'factor elems':>13} {'2nd-order elems':>16} "
            f"{'layers':>7}",
        ]
        for r in range(self.world_size):
            load = self.rank_load(r)
            owned = sum(1 for lp in self.layers if lp.is_decomposer(r))
            lines.append(
                f"  {r:>4} {load['decomposition_cost']:>14.4g} {load['factor_elements']:>13.0f} "
                f"{load['second_order_elements']:>16.0f} {owned:>7}"
            )
        lines.append(f"  {'layer':<32} {'A':>6} {'G':>6} {'A on':>5} {'G on':>5}  workers")
        for lp in self.layers:
            lines.append(
                f"  {lp.name:<32} {lp.a_dim:>6} {lp.g_dim:>6} {lp.a_decomposer:>5} "
                f"{lp.g_decomposer:>5}  {list(lp.grad_workers)}"
            )
        return "\n".join(lines)


def make_plan(
    layers: Sequence[LayerSpec],
    world_size: int,
    grad_worker_fraction: float | DistributedStrategy = DistributedStrategy.COMM_OPT,
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
) -> WorkPlan:
    """Greedy longest-processing-time assignment of decompositions to ranks.

    Layers are taken largest first; each goes to the worker group with the
    least total load, and inside it each factor (or, colocated, the pair)
    goes to the least-loaded rank.  Ties go to the lowest rank, so every
    process computes the same plan.
    """
    strategy = AssignmentStrategy(assignment_strategy)
    m = grad_workers_for(grad_worker_fraction, world_size)
    names = [spec.name for spec in layers]
    if len(set(names)) != len(names):
        raise ValueError("layer names must be unique")
    worker_groups = [list(range(s, s + m)) for s in range(0, world_size, m)]
    receiver_groups = [list(range(i, world_size, m)) for i in range(m)]
    load = [0.0] * world_size

    def least_loaded(ranks: Sequence[int]) -> int:
        return min(ranks, key=lambda r: (load[r], r))

    order = sorted(
        range(len(layers)),
        key=lambda i: (-(_cost(layers[i].a_dim, strategy) + _cost(layers[i].g_dim, strategy)), i),
    )
    planned: dict[int, LayerPlan] = {}
    for i in order:
        spec = layers[i]
        cost_a, cost_g = _cost(spec.a_dim, strategy), _cost(spec.g_dim, strategy)
        group = min(worker_groups, key=lambda g: (sum(load[r] for r in g), g[0]))
        if colocate_factors:
            a_rank = g_rank = least_loaded(group)
            load[a_rank] += cost_a + cost_g
        else:
            big_first = [("a", cost_a), ("g", cost_g)]
            big_first.sort(key=lambda t: -t[1])
            chosen: dict[str, int] = {}
            for which, cost in big_first:
                rank = least_loaded(group)
                chosen[which] = rank
                load[rank] += cost
            a_rank, g_rank = chosen["a"], chosen["g"]
        workers = tuple(group)
        groups = tuple((w, *[r for r in receiver_groups[w % m] if r != w]) for w in workers)
        planned[i] = LayerPlan(
            name=spec.name,
            a_dim=spec.a_dim,
            g_dim=spec.g_dim,
            a_decomposer=a_rank,
            g_decomposer=g_rank,
            grad_workers=workers,
            receiver_groups=groups,
        )
    return WorkPlan(
        world_size=world_size,
        grad_workers=m,
        assignment_strategy=strategy,
        colocate_factors=colocate_factors,
        layers=tuple(planned[i] for i in range(len(layers))),
    )
