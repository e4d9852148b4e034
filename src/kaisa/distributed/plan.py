"""The KAISA work plan: a pure function from layer sizes to who does what.

Given the factor specs of every layer, the size W of the data-parallel group
and the gradient worker fraction f, :func:`make_plan` decides

* which rank decomposes each factor (greedy longest-processing-time balance
  by the factor's cost: n³ for ``'compute'`` or n² for ``'memory'``, n for a
  diagonal factor);
* which ranks are each layer's *gradient workers* — they hold its
  eigenbases (or inverses) and compute its preconditioned gradient;
* which ranks receive the preconditioned gradient from which worker.

The ranks form an ``m × n`` grid (m = f·W workers per layer, n = W/m),
row-major as KAISA lays it out: the n *worker groups* are its columns
``{g, g+n, g+2n, …}`` and the m *receiver groups* its rows, n consecutive
ranks each.  A layer is given to one worker group; its decomposer(s) sit in
that group and broadcast the second-order tensors to the group on
inverse-update steps; each worker then broadcasts the preconditioned
gradient to the rest of its row, every step.  The per-step traffic thus stays
among consecutive ranks — inside a node when n is at most the GPUs per node —
and only the infrequent inverse broadcast crosses nodes.  f = 1 (COMM-OPT)
makes every rank a worker of every layer and removes the per-step broadcast;
f = 1/W (MEM-OPT) makes one worker per layer.

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

import numpy as np

from kaisa.config import AssignmentStrategy, DistributedStrategy
from kaisa.core.specs import FactorKind, FactorSpec, kfac_factors

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
    """Who does what for one layer (ranks are positions in the data-parallel group).

    The gradient workers are a column ``g, g + n, …, g + (m−1)·n`` of the
    ``m × n`` rank grid (``n = W/m``), so worker ``b·n + g`` serves the ranks
    ``[b·n, (b+1)·n)`` of its row: every lookup on the step path is O(1) and
    the receiver groups are derived, not stored (at W = 4096 storing them per
    layer would cost gigabytes).
    """

    name: str
    factors: tuple[FactorSpec, ...]
    owners: tuple[int, ...]  #: the rank that reduces, keeps and decomposes each factor
    grad_workers: tuple[int, ...]
    world_size: int

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

    @property
    def _row(self) -> int:
        """n = W/m: the length of a receiver group (a row of the rank grid)."""
        return self.world_size // len(self.grad_workers)

    def is_grad_worker(self, rank: int) -> bool:
        return rank % self._row == self.grad_workers[0]

    def gradient_source(self, rank: int) -> int:
        """The gradient worker whose preconditioned gradient ``rank`` uses (O(1)):
        the one in ``rank``'s row."""
        return self.grad_workers[rank // self._row]

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        """The worker serving ``rank`` first, then every rank it serves."""
        n = self._row
        src = self.gradient_source(rank)
        first = rank - rank % n
        return (src, *(r for r in range(first, first + n) if r != src))

    @property
    def worker_slice(self) -> slice:
        """The gradient workers as a slice of a per-rank array (a grid column)."""
        return slice(self.grad_workers[0], self.world_size, self._row)

    @property
    def receiver_groups(self) -> tuple[tuple[int, ...], ...]:
        """One group per gradient worker: the worker, then the ranks it sends to."""
        return tuple(self.receiver_group_of(w) for w in self.grad_workers)


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
    if fraction is DistributedStrategy.AUTO:
        raise ValueError(
            "grad_worker_fraction='auto' is resolved by the preconditioner at start-up "
            "(kaisa.planner.forecast.choose_fraction), not by the plan"
        )
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
    def receivers_per_group(self) -> int:
        """n = W/m: the worker groups, and the ranks of each receiver group."""
        return self.world_size // self.grad_workers

    @functools.cached_property
    def worker_groups(self) -> tuple[tuple[int, ...], ...]:
        """The columns ``{g, g+n, …}`` of the ``m × n`` rank grid."""
        n = self.receivers_per_group
        return tuple(tuple(range(g, self.world_size, n)) for g in range(n))

    @functools.cached_property
    def receiver_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rows of the rank grid: n consecutive ranks each."""
        n = self.receivers_per_group
        return tuple(tuple(range(b, b + n)) for b in range(0, self.world_size, n))

    def worker_group_of(self, rank: int) -> tuple[int, ...]:
        """The worker group (grid column) ``rank`` belongs to (O(1))."""
        return self.worker_groups[rank % self.receivers_per_group]

    def receiver_group_of(self, rank: int) -> tuple[int, ...]:
        """The receiver group (grid row) ``rank`` belongs to (O(1))."""
        return self.receiver_groups[rank // self.receivers_per_group]

    @property
    def grad_worker_fraction(self) -> float:
        return self.grad_workers / self.world_size

    @functools.cached_property
    def _by_name(self) -> dict[str, LayerPlan]:
        return {lp.name: lp for lp in self.layers}

    def layer(self, name: str) -> LayerPlan:
        """The plan of one layer (O(1): it is looked up for every layer every step)."""
        return self._by_name[name]

    def loads(self) -> dict[str, np.ndarray]:
        """Per-rank work and memory for every rank at once, in element counts."""
        w = self.world_size
        out = {
            k: np.zeros(w)
            for k in (
                "decomposition_cost",
                "factor_elements",
                "second_order_elements",
                "precondition_flops",
                "layers_owned",
            )
        }
        for lp in self.layers:
            for spec, owner in zip(lp.factors, lp.owners):
                out["decomposition_cost"][owner] += spec.cost(self.assignment_strategy)
                out["factor_elements"][owner] += spec.numel
            for owner in set(lp.owners):
                out["layers_owned"][owner] += 1
            # eigenbases (or inverses) plus the eigenvalue outer product
            numel = math.prod(spec.dim for spec in lp.factors)
            workers = lp.worker_slice
            out["second_order_elements"][workers] += sum(spec.numel for spec in lp.factors) + numel
            out["precondition_flops"][workers] += 4.0 * numel * sum(map(_width, lp.factors))
        return out

    def rank_load(self, rank: int) -> dict[str, float]:
        """Per-rank work and memory in element counts (not bytes)."""
        loads = self.loads()
        return {k: float(v[rank]) for k, v in loads.items() if k != "layers_owned"}

    def describe(self, max_rows: int = 64) -> str:
        """A readable table of the plan: groups, per-rank load, per-layer owners.

        Beyond ``max_rows`` ranks or layers it summarises (min / median / max
        over ranks, the largest layers), so it stays fast at W = 4096."""
        loads = self.loads()
        m, w = self.grad_workers, self.world_size
        lines = [
            f"WorkPlan: world_size={w}, grad_workers={m} "
            f"(fraction {self.grad_worker_fraction:g}), "
            f"assignment={self.assignment_strategy.value}, "
            f"colocate_factors={self.colocate_factors}",
            f"  worker groups:   {_groups(self.worker_groups, max_rows)}",
            f"  receiver groups: {_groups(self.receiver_groups, max_rows)}",
            f"  {'rank':>6} {'decomp cost':>14} {'factor elems':>13} {'2nd-order elems':>16} "
            f"{'layers':>7}",
        ]
        columns = ("decomposition_cost", "factor_elements", "second_order_elements")
        if w <= max_rows:
            rows = [
                (str(r), [loads[k][r] for k in columns], loads["layers_owned"][r]) for r in range(w)
            ]
        else:
            rows = [
                (label, [fn(loads[k]) for k in columns], fn(loads["layers_owned"]))
                for label, fn in (("min", np.min), ("median", np.median), ("max", np.max))
            ]
        for label, (cost, factors, second), owned in rows:
            lines.append(
                f"  {label:>6} {cost:>14.4g} {factors:>13.0f} {second:>16.0f} {owned:>7.0f}"
            )
        shown = self.layers
        if len(shown) > max_rows:
            shown = tuple(
                sorted(
                    shown, key=lambda lp: -sum(s.cost(self.assignment_strategy) for s in lp.factors)
                )
            )[:max_rows]
            lines.append(f"  the {max_rows} largest of {len(self.layers)} layers:")
        lines.append(f"  {'layer':<32} {'factors (size on rank)':<30} workers")
        for lp in shown:
            where = ", ".join(
                f"{s.name}:{s.dim}{_suffix(s)} on {o}" for s, o in zip(lp.factors, lp.owners)
            )
            workers = (
                list(lp.grad_workers)
                if len(lp.grad_workers) <= 8
                else (f"[{lp.grad_workers[0]}..{lp.grad_workers[-1]}]")
            )
            lines.append(f"  {lp.name:<32} {where:<30} {workers}")
        return "\n".join(lines)


def _width(spec: FactorSpec) -> int:
    """Entries of the factor's matrix one gradient entry is multiplied by:
    its size, or a block-diagonal factor's largest block."""
    return spec.layout.largest if spec.kind is FactorKind.BLOCK_DIAGONAL else spec.dim


def _suffix(spec: FactorSpec) -> str:
    """``d`` for a diagonal factor, ``[8×4000]`` for a block-diagonal one."""
    if spec.kind is FactorKind.DIAGONAL:
        return "d"
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        return f"[{spec.layout.describe()}]"
    return ""


def _groups(groups: tuple[tuple[int, ...], ...], limit: int) -> str:
    if len(groups) <= limit and all(len(g) <= limit for g in groups):
        return str(list(map(list, groups)))
    noun = "group" if len(groups) == 1 else "groups"
    return f"{len(groups)} {noun} of {len(groups[0])} (e.g. {_span(groups[0])})"


def _span(group: tuple[int, ...]) -> str:
    """A group's ranks, elided in the middle only where there is a middle:
    ``0``, ``0, 64``, ``0, 64, 128``, ``0, 64, …, 4032``."""
    if len(group) <= 3:
        return ", ".join(map(str, group))
    return f"{group[0]}, {group[1]}, …, {group[-1]}"


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
    n = world_size // m
    worker_groups = [tuple(range(g, world_size, n)) for g in range(n)]  # grid columns
    load = np.zeros(world_size)
    group_load = np.zeros(len(worker_groups))

    def least_loaded(g: int) -> int:
        return g + n * int(np.argmin(load[g::n]))  # ties: the lowest rank

    def total_cost(spec: LayerSpec) -> float:
        return sum(f.cost(strategy) for f in spec.factors)

    order = sorted(range(len(layers)), key=lambda i: (-total_cost(layers[i]), i))
    planned: dict[int, LayerPlan] = {}
    for i in order:
        spec = layers[i]
        g = int(np.argmin(group_load))  # ties: the lowest group
        owners = [0] * len(spec.factors)
        if colocate_factors:
            rank = least_loaded(g)
            owners = [rank] * len(spec.factors)
            load[rank] += total_cost(spec)
        else:
            costs = [f.cost(strategy) for f in spec.factors]
            big_first = sorted(range(len(costs)), key=lambda k: -costs[k])
            for k in big_first:
                rank = least_loaded(g)
                owners[k] = rank
                load[rank] += costs[k]
        group_load[g] += total_cost(spec)
        planned[i] = LayerPlan(
            name=spec.name,
            factors=spec.factors,
            owners=tuple(owners),
            grad_workers=worker_groups[g],  # shared, not copied per layer
            world_size=world_size,
        )
    return WorkPlan(
        world_size=world_size,
        grad_workers=m,
        assignment_strategy=strategy,
        colocate_factors=colocate_factors,
        layers=tuple(planned[i] for i in range(len(layers))),
    )
