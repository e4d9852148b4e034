"""The KAISA work plan: a pure function from layer sizes to who does what.

Given the factor specs of every layer, the size W of the data-parallel group
and the gradient worker fraction f, :func:`make_plan` decides

* which rank decomposes each factor (greedy longest-processing-time balance
  by the factor's cost: n³ for ``'compute'`` or n² for ``'memory'``, n for a
  diagonal factor);
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

Ranks here are positions in the data-parallel group (0 … W−1), not global
ranks: ranks that hold other parts of the model (tensor or pipeline
parallelism) each plan over their own data-parallel group.  Nothing here
touches ``torch.distributed``: the plan is immutable, printable
(:meth:`WorkPlan.describe`) and unit-testable without processes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kaisa.config import AssignmentStrategy, DistributedStrategy
from kaisa.factors import FactorKind, FactorSpec, kfac_factors

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
    """What the planner needs to know of a layer: its factors."""

    name: str
    factors: tuple[FactorSpec, ...]

    @classmethod
    def kfac(cls, name: str, a_dim: int, g_dim: int) -> LayerSpec:
        """A Linear/Conv2d-like layer: dense A (inputs) and dense G (output gradients)."""
        return cls(name, kfac_factors(a_dim, g_dim))


@dataclass(frozen=True)
class LayerPlan:
    """Who does what for one layer (ranks are positions in the data-parallel group)."""

    name: str
    factors: tuple[FactorSpec, ...]
    owners: tuple[int, ...]  #: the rank that reduces, keeps and decomposes each factor
    grad_workers: tuple[int, ...]
    #: one group per gradient worker: the worker first, then the ranks it
    #: sends the preconditioned gradient to (itself included, as in a broadcast)
    receiver_groups: tuple[tuple[int, ...], ...]

    @property
    def colocated(self) -> bool:
        return len(set(self.owners)) == 1

    def owner_of(self, factor: str) -> int:
        """The owner of the factor called ``factor``."""
        for spec, owner in zip(self.factors, self.owners):
            if spec.name == factor:
                return owner
        raise KeyError(f"layer {self.name!r} has no factor {factor!r}")

    def is_decomposer(self, rank: int) -> bool:
        return rank in self.owners

    def is_grad_worker(self, rank: int) -> bool:
        return rank in self.grad_workers

    def gradient_source(self, rank: int) -> int:
        """The gradient worker whose preconditioned gradient ``rank`` uses."""
        return self.receiver_group_of(rank)[0]

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
            for spec, owner in zip(lp.factors, lp.owners):
                if owner == rank:
                    decomposition_cost += spec.cost(self.assignment_strategy)
                    factor_elems += spec.numel
            if lp.is_grad_worker(rank):
                # eigenbases (or inverses) plus the eigenvalue outer product
                numel = math.prod(spec.dim for spec in lp.factors)
                second_order_elems += sum(spec.numel for spec in lp.factors) + numel
                precondition_flops += 4.0 * numel * sum(spec.dim for spec in lp.factors)
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
        lines.append(f"  {'layer':<32} {'factors (size on rank)':<30} workers")
        for lp in self.layers:
            where = ", ".join(
                f"{s.name}:{s.dim}{'d' if s.kind is FactorKind.DIAGONAL else ''} on {o}"
                for s, o in zip(lp.factors, lp.owners)
            )
            lines.append(f"  {lp.name:<32} {where:<30} {list(lp.grad_workers)}")
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

    def total_cost(spec: LayerSpec) -> float:
        return sum(f.cost(strategy) for f in spec.factors)

    order = sorted(range(len(layers)), key=lambda i: (-total_cost(layers[i]), i))
    planned: dict[int, LayerPlan] = {}
    for i in order:
        spec = layers[i]
        group = min(worker_groups, key=lambda g: (sum(load[r] for r in g), g[0]))
        owners = [0] * len(spec.factors)
        if colocate_factors:
            rank = least_loaded(group)
            owners = [rank] * len(spec.factors)
            load[rank] += total_cost(spec)
        else:
            costs = [f.cost(strategy) for f in spec.factors]
            big_first = sorted(range(len(costs)), key=lambda k: -costs[k])
            for k in big_first:
                rank = least_loaded(group)
                owners[k] = rank
                load[rank] += spec.factors[k].cost(strategy)
        workers = tuple(group)
        groups = tuple((w, *[r for r in receiver_groups[w % m] if r != w]) for w in workers)
        planned[i] = LayerPlan(
            name=spec.name,
            factors=spec.factors,
            owners=tuple(owners),
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
