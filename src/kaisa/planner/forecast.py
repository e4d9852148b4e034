"""Predict a KAISA run before it starts: memory, bytes and time per rank.

Everything is read from the same declarations the preconditioner runs on —
the layers' factor specs, the curvature method's held and sent tensors, the
work plan's owners and worker blocks, the packing rule of the communicator —
so the predicted bytes are the bytes :meth:`KFACPreconditioner.comm_stats`
counts, kind by kind, and the predicted memory is what
:meth:`KFACPreconditioner.memory_usage` reports between steps.  Time is a
model on top (:class:`kaisa.planner.costs.CostModel`): decompositions on their
owners, products on the workers, collectives over a link.

Nothing here communicates or allocates factor-sized tensors, so a plan for
4096 ranks is computed on a laptop (per-rank sums are numpy vectors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kaisa.config import (
    DistributedStrategy,
    KFACConfig,
    layer_dtypes,
)
from kaisa.core.specs import FactorKind, FactorSource, FactorSpec, StatisticDtype, StatisticSpec
from kaisa.core.workspace import MAX_OPERAND_NUMEL, uses_workspace, workspace_bytes
from kaisa.distributed import messages
from kaisa.distributed.plan import (
    LayerSpec,
    WorkPlan,
    allowed_fractions,
    grad_workers_for,
    make_plan,
)
from kaisa.layers.base import sole_owners
from kaisa.layers.registry import register_layers
from kaisa.methods import resolve_method
from kaisa.methods.base import CurvatureMethod, HeldTensor, Operands
from kaisa.methods.capabilities import stacked_apply
from kaisa.planner.costs import CostModel

__all__ = [
    "STAGES",
    "Forecast",
    "LayerCost",
    "choose_fraction",
    "forecast",
    "fractions_for",
    "layer_costs",
]

#: the stages of a step the time model predicts, in the order the data flows
STAGES = (
    "capture",
    "factor_comm",
    "factor_fold",
    "decompose",
    "inverse_comm",
    "precondition",
    "grad_comm",
)


@dataclass(frozen=True)
class LayerCost:
    """What the forecast needs of one layer (sizes and dtypes, no tensors)."""

    name: str
    factors: tuple[FactorSpec, ...]
    grad_shape: tuple[int, int]  #: the gradient matrix (rows = G side, cols = A side)
    factor_itemsize: int
    inv_itemsize: int
    grad_itemsize: int
    rows: int | None = None  #: data rows per factor step (Gram cost), if measured
    #: times the input rows are written before their Gram: once (a Linear's
    #: bias column; a convolution's patches, written once from a strided
    #: view into a reused buffer, see kaisa.layers.patches)
    input_copies: int = 1
    #: its products reuse the CPU workspace (:mod:`kaisa.core.workspace`): on CPU,
    #: owning whole parameters no other layer shares
    reuses_workspace: bool = False
    #: the factors ``max_factor_dim`` made diagonal or block-diagonal, as kept
    limited: tuple[FactorSpec, ...] = ()

    def limited_labels(self) -> list[str]:
        """``head.G (32000 diagonal)`` for each of :attr:`limited` (``kaisa plan``)."""
        return [f"{self.name}.{s.name} ({s.label})" for s in self.limited]


def layer_costs(
    model: nn.Module,
    rows: Mapping[str, int] | None = None,
    *,
    device: torch.device | str | None = None,
    **kfac: Any,
) -> list[LayerCost]:
    """The layers ``KFACPreconditioner(model, **kfac)`` would register, as sizes.

    ``device``: where the run's layers will live, when not where ``model``
    is now (a model built on the CPU to plan a GPU run): the CPU workspace
    (:mod:`kaisa.core.workspace`) is held only on the CPU, so a plan for a GPU
    must not count it.  None: each layer's own device."""
    where = torch.device(device) if device is not None else None
    config = KFACConfig.from_options(
        **{k: v for k, v in kfac.items() if k in KFACConfig.field_names()}
    )
    adapters, _ = register_layers(model, config.skip_layers)
    # as TorchEngine.rescalable: a layer that owns whole parameters, unshared
    owns = sole_owners(adapters)
    out = []
    for adapter, whole in zip(adapters, owns):
        factor, inv = layer_dtypes(config, adapter.weight.dtype)
        adapter.max_factor_dim = config.max_factor_dim
        adapter.large_factor = config.large_factor
        g, a = adapter.matrix_shape
        out.append(
            LayerCost(
                name=adapter.name,
                factors=adapter.effective_specs(),
                grad_shape=(g, a),
                factor_itemsize=factor.itemsize,
                inv_itemsize=inv.itemsize,
                grad_itemsize=adapter.weight.dtype.itemsize,
                rows=None if rows is None else rows.get(adapter.name),
                reuses_workspace=whole
                and uses_workspace(where or adapter.device, g * a, adapter.weight.element_size()),
                limited=adapter.limited_specs(),
            )
        )
    return out


@dataclass
class Forecast:
    """One configuration at one world size; per-rank figures are numpy vectors.

    ``bytes_*`` map a ``comm_stats()`` kind to bytes per rank on that kind of
    step (a step that updates factors, one that also decomposes, and every
    step); ``memory`` maps a ``memory_usage()`` key to bytes per rank.
    """

    world_size: int
    fraction: float
    grad_workers: int
    config: dict[str, Any]
    memory: dict[str, np.ndarray]
    bytes_factor_step: dict[str, np.ndarray]
    bytes_inverse_step: dict[str, np.ndarray]
    bytes_every_step: dict[str, np.ndarray]
    seconds: dict[str, np.ndarray] = field(default_factory=dict)

    def step_bytes(self, rank: int, factor_step: bool, inverse_step: bool) -> dict[str, int]:
        """What ``comm_stats()['step']`` should show on ``rank`` after such a step."""
        out: dict[str, int] = {}
        tables = [self.bytes_every_step]
        tables += [self.bytes_factor_step] if factor_step else []
        tables += [self.bytes_inverse_step] if inverse_step else []
        for table in tables:
            for kind, per_rank in table.items():
                if per_rank[rank]:
                    out[kind] = out.get(kind, 0) + int(per_rank[rank])
        return out

    def average_bytes(self) -> np.ndarray:
        """Bytes per step per rank, averaged over the update intervals."""
        f, i = self.config["factor_update_steps"], self.config["inv_update_steps"]
        return (
            _total(self.bytes_every_step)
            + _total(self.bytes_factor_step) / f
            + _total(self.bytes_inverse_step) / i
        )

    def overhead(self) -> np.ndarray:
        """Predicted seconds K-FAC adds to a step, per rank (amortised)."""
        return _total(self.seconds)

    def summary(self, budget: float | None = None) -> dict[str, Any]:
        memory = self.memory["total"]
        return {
            "world_size": self.world_size,
            "grad_worker_fraction": self.fraction,
            "grad_workers": self.grad_workers,
            "memory_max_bytes": int(memory.max()),
            "memory_mean_bytes": float(memory.mean()),
            "bytes_per_step": float(self.average_bytes().max()),
            "bytes_factor_step": int(_total(self.bytes_factor_step).max()),
            "bytes_inverse_step": int(_total(self.bytes_inverse_step).max()),
            "bytes_every_step": int(_total(self.bytes_every_step).max()),
            "overhead_s": float(self.overhead().max()),
            "seconds": {k: float(v.max()) for k, v in self.seconds.items()},
            "fits": budget is None or bool(memory.max() <= budget),
        }


def _total(table: Mapping[str, np.ndarray]) -> np.ndarray:
    return sum(table.values(), np.zeros(1))


def _bytes(tensors: Sequence[HeldTensor], itemsize: int, symmetry_aware: bool) -> int:
    """A second-order broadcast: the transfer's tensors as the communicator packs them."""
    return itemsize * messages.message_numel(tensors, symmetry_aware)


def _product_flop(layer: LayerCost, method: CurvatureMethod) -> float:
    """Multiplying the gradient matrix by each dense (or block-diagonal)
    factor's matrix as often as the method declares
    (:attr:`CurvatureMethod.products_per_factor`: twice for an eigenbasis,
    into it and back; once for an inverse); a block-diagonal factor's rows
    are its blocks' (``Σ b²/d`` multiply-adds per entry instead of ``d``)."""
    numel = layer.grad_shape[0] * layer.grad_shape[1]
    per = sum(
        2.0 * numel * s.numel / s.dim for s in layer.factors if s.kind is not FactorKind.DIAGONAL
    )
    return per * method.products_per_factor


def _decompose_seconds(cost: CostModel, spec: FactorSpec, method: CurvatureMethod) -> float:
    """One factor's decomposition with the method's declared kernel: a
    block-diagonal factor's blocks one by one."""
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        groups = spec.layout.groups
        return sum(g.count * cost.decompose(g.size, method.kernel, True) for g in groups)
    return cost.decompose(spec.dim, method.kernel, spec.kind is FactorKind.DENSE)


def _add_statistics(
    t: _Tally,
    layer: LayerCost,
    statistics: Sequence[StatisticSpec],
    cost: CostModel,
    sym: bool,
) -> None:
    """The statistics a method declares beyond the factors: summed onto every
    rank on factor steps (``statistic_allreduce``), their terms formed on
    every rank (``flop_per_row``), folded on the workers (every rank)."""
    for stat in statistics:
        itemsize = (
            layer.inv_itemsize
            if stat.dtype is StatisticDtype.SECOND_ORDER
            else (layer.factor_itemsize)
        )
        nbytes = itemsize * messages.statistic_numel(stat, sym)
        t.factor_step["statistic_allreduce"] += nbytes
        t.secs["factor_fold"] += cost.traffic(3.0 * stat.numel * itemsize)
        if layer.rows is not None:
            t.secs["capture"] += cost.compute(layer.rows * stat.flop_per_row)
    t.factor_step["factor_counts"] += messages.COUNT_DTYPE.itemsize * len(statistics)


@dataclass
class _Tally:
    """The per-rank tables a forecast fills (kinds and stages as in :class:`Forecast`)."""

    memory: dict[str, np.ndarray]
    factor_step: dict[str, np.ndarray]
    inverse_step: dict[str, np.ndarray]
    every_step: dict[str, np.ndarray]
    secs: dict[str, np.ndarray]

    @classmethod
    def zeros(cls, w: int) -> _Tally:
        def table(*keys: str) -> dict[str, np.ndarray]:
            return {k: np.zeros(w) for k in keys}

        return cls(
            memory=table("factors", "batch_statistics", "second_order", "workspace", "stacked"),
            factor_step=table("factor_reduce", "factor_counts", "statistic_allreduce"),
            inverse_step=table("second_order_broadcast", "allreduce"),
            every_step=table("grad_broadcast", "agree"),
            secs=table(*STAGES),
        )


def _add_factors(
    t: _Tally,
    layer: LayerCost,
    owners: Sequence[int],
    cost: CostModel,
    sym: bool,
    gram_dtype: torch.dtype | None = None,
) -> None:
    """One layer's factors: held by their owners, reduced to them and folded
    there on factor steps, captured on every rank; the Grams at the rate of
    ``gram_dtype`` (``factor_compute_dtype``)."""
    for spec, owner in zip(layer.factors, owners):
        t.memory["factors"][owner] += spec.numel * layer.factor_itemsize
        t.factor_step["factor_reduce"] += layer.factor_itemsize * messages.statistic_numel(
            spec, sym
        )
        # the owner folds the reduced sum into the running average: the
        # factor is read and written and the sum read (division by the
        # count, finiteness check and lerp_ measured at about three passes)
        t.secs["factor_fold"][owner] += cost.traffic(3.0 * spec.numel * layer.factor_itemsize)
        if layer.rows is not None:
            # the rows are written and read (memory-bound), then their Gram
            # is a product (a diagonal factor only counts; a block-diagonal
            # one's products are its blocks': Σ b² entries)
            dense = spec.kind is not FactorKind.DIAGONAL
            copies = layer.input_copies if spec.source is FactorSource.INPUT else 1
            t.secs["capture"] += cost.traffic(2.0 * layer.rows * spec.dim * 4 * copies)
            flop = layer.rows * (2.0 * spec.numel if dense else 1)
            t.secs["capture"] += cost.compute(flop, gram_dtype if dense else None)
    t.factor_step["factor_counts"] += messages.COUNT_DTYPE.itemsize * len(layer.factors)


def _add_grad_broadcast(
    t: _Tally, plan: WorkPlan, grad_bytes: int, calls: int, cost: CostModel
) -> None:
    """Every step, one broadcast per layer inside each receiver row (n
    consecutive ranks: inside a node when n ≤ ranks per node); the cost is
    affine in bytes and calls, so the layers' bytes are added up first."""
    t.every_step["grad_broadcast"] += grad_bytes
    n, w = plan.receivers_per_group, plan.world_size
    for first in range(0, w, n):
        row = range(first, first + n)
        t.secs["grad_comm"][first : first + n] += cost.collective(grad_bytes, row, calls)


def _config_of(kfac: dict[str, Any]) -> KFACConfig:
    """The options forecast; a misspelt one would otherwise forecast the default silently."""
    unknown = sorted(set(kfac) - set(KFACConfig.field_names()))
    if unknown:
        raise TypeError(
            f"forecast() got unknown option(s) {unknown}; "
            f"allowed: {sorted(KFACConfig.field_names())}"
        )
    return KFACConfig.from_options(**kfac)


def forecast(
    layers: Sequence[LayerCost],
    world_size: int,
    cost: CostModel | None = None,
    *,
    gradients_agree: bool = True,
    method: CurvatureMethod | None = None,
    **kfac: Any,
) -> Forecast:
    """Predict one configuration (``**kfac``: KFACPreconditioner keywords).

    ``method``: the preconditioner's ``method=`` when one is given; the
    method forecast is resolved as the preconditioner resolves it
    (:func:`kaisa.methods.resolve_method`: ``compute_method``, ``grafting``),
    so the forecast counts the state the run holds.

    ``gradients_agree``: gradients are averaged by DDP or an engine (no
    per-step presence vote); False for hand-averaged gradients.  Each
    collective is costed over its own group of ranks (factors: all W; a
    layer's decompositions: its worker column; gradients: each receiver
    row), so a node-aware ``cost`` tells the in-node ones from the others.
    """
    config = _config_of(kfac)
    cost = cost or CostModel()
    plan = make_plan(
        [LayerSpec(la.name, la.factors) for la in layers],
        world_size,
        config.grad_worker_fraction,
        config.assignment_strategy,
        config.colocate_factors,
    )
    method = resolve_method(method, config)
    w, sym = world_size, config.symmetry_aware
    t = _Tally.zeros(w)
    exchange, grad_bytes = 0, 0
    for layer in layers:
        lp = plan.layer(layer.name)
        workers, m = lp.worker_slice, len(lp.grad_workers)
        _add_factors(t, layer, lp.owners, cost, sym, config.factor_compute_dtype)
        extra = method.statistics(layer.factors)[len(layer.factors) :]
        _add_statistics(t, layer, extra, cost, sym)
        held = method.held(layer.factors, lp.colocated)
        itemsize = layer.inv_itemsize
        copy = config.precondition_dtype
        if copy is not None and copy.itemsize != itemsize:
            itemsize += copy.itemsize  # cast copies the products run on (kaisa.core.precision)
        t.memory["second_order"][workers] += sum(h.numel for h in held) * itemsize
        # a layer whose factors this rank does not own: the vector's size
        vector = method.exchange(Operands(layer.factors, {}, [None] * len(layer.factors)))
        exchange += 0 if vector is None else vector.numel()
        for transfer in method.transfers(layer.factors, lp.colocated):
            owner = lp.owners[transfer.factors[0]]
            for i in transfer.factors:
                spec = layer.factors[i]
                t.secs["decompose"][owner] += _decompose_seconds(cost, spec, method)
            if m > 1:
                sent = _bytes(transfer.tensors, layer.inv_itemsize, sym)
                t.inverse_step["second_order_broadcast"][workers] += sent
                # over the layer's worker column {g, g+n, …}: across nodes
                column = range(w)[workers]
                t.secs["inverse_comm"][workers] += cost.collective(sent, column, 1)
        t.secs["precondition"][workers] += cost.compute(
            _product_flop(layer, method), config.precondition_dtype
        )
        message = messages.grad_message(layer.grad_shape)
        grad_bytes += messages.message_numel(message, False) * layer.grad_itemsize
    if plan.grad_workers < w:
        _add_grad_broadcast(t, plan, grad_bytes, len(layers), cost)
    else:
        served = [la for la in layers if la.reuses_workspace]
        if served:
            largest = max(la.grad_shape[0] * la.grad_shape[1] for la in served)
            first = served[0]
            t.memory["workspace"][:] = workspace_bytes(
                largest, first.grad_itemsize, _compute_itemsize(first, config)
            )
    t.memory["stacked"][:] = _stacked_bytes(layers, plan, method, config)
    _add_group_collectives(t, plan, config, cost, exchange, gradients_agree, len(layers))
    return _finish(t, plan, config, method.name, sym)


def _add_group_collectives(
    t: _Tally,
    plan: WorkPlan,
    config: KFACConfig,
    cost: CostModel,
    exchange: int,
    gradients_agree: bool,
    n_layers: int,
) -> None:
    """The collectives over the whole group: factor sums and counts, the
    eigenvalue exchange, the presence vote; none in one process."""
    w = plan.world_size
    if w == 1:
        for table in (t.factor_step, t.inverse_step, t.every_step):
            for v in table.values():
                v[:] = 0
        return
    if exchange and not plan.colocate_factors:
        t.inverse_step["allreduce"] += 8 * exchange
    if not gradients_agree:
        # each layer's gradient presence, and the gradients' finiteness
        # verdict riding in the same vote (kaisa.step.verdict)
        t.every_step["agree"] += 4 * (n_layers + 1)
    cap = max(config.allreduce_bucket_cap_mb * 2**20, 1.0)
    reduce_bytes = float(t.factor_step["factor_reduce"][0])
    calls = max(len(set(o for la in plan.layers for o in la.owners)), reduce_bytes / cap)
    everyone = range(w)
    counts, allreduce = t.factor_step["factor_counts"][0], t.inverse_step["allreduce"][0]
    statistics = float(t.factor_step["statistic_allreduce"][0])
    t.secs["factor_comm"] += cost.collective(int(reduce_bytes), everyone, int(np.ceil(calls)))
    t.secs["factor_comm"] += cost.collective(int(statistics), everyone, 1, True)
    t.secs["factor_comm"] += cost.collective(int(counts), everyone, 1, True)
    t.secs["inverse_comm"] += cost.collective(int(allreduce), everyone, 1, True)


def _stacked_bytes(
    layers: Sequence[LayerCost], plan: WorkPlan, method: CurvatureMethod, config: KFACConfig
) -> np.ndarray:
    """Each rank's stacked copies of the operands of the layers it
    preconditions together (:class:`kaisa.step.batched.ShapeGroups`, whose
    grouping rule this mirrors: dense factors, the same operand and gradient
    shapes and dtypes, operands of at most ``MAX_OPERAND_NUMEL``; a group is
    two layers or more of which this rank is a gradient worker)."""
    w = plan.world_size
    total = np.zeros(w)
    if stacked_apply(method) is None:
        return total
    by_key: dict[tuple[object, ...], list[tuple[slice, int]]] = {}
    for layer in layers:
        if any(spec.kind is not FactorKind.DENSE for spec in layer.factors):
            continue
        lp = plan.layer(layer.name)
        held = method.held(layer.factors, lp.colocated)
        if not held or any(h.numel > MAX_OPERAND_NUMEL for h in held):
            continue
        itemsize = _compute_itemsize(layer, config)
        key = (
            tuple((spec.dim, spec.axis) for spec in layer.factors),
            tuple(sorted((h.key, h.shape) for h in held)),
            itemsize,
            layer.grad_shape,
            layer.grad_itemsize,
        )
        by_key.setdefault(key, []).append((lp.worker_slice, sum(h.numel for h in held) * itemsize))
    for members in by_key.values():
        count, held_bytes = np.zeros(w), np.zeros(w)
        for workers, nbytes in members:
            count[workers] += 1
            held_bytes[workers] += nbytes
        total += np.where(count > 1, held_bytes, 0)
    return total


def _compute_itemsize(layer: LayerCost, config: KFACConfig) -> int:
    """The dtype the products run in: ``precondition_dtype``, else ``inv_dtype``'s."""
    copy = config.precondition_dtype
    return copy.itemsize if copy is not None else layer.inv_itemsize


def _finish(t: _Tally, plan: WorkPlan, config: KFACConfig, method: str, sym: bool) -> Forecast:
    """Total the memory, amortise the stages over their intervals, wrap up."""
    t.memory["total"] = t.memory["factors"] + t.memory["batch_statistics"]
    t.memory["total"] = t.memory["total"] + t.memory["second_order"] + t.memory["workspace"]
    t.memory["total"] = t.memory["total"] + t.memory["stacked"]
    f, i = _interval(config.factor_update_steps), _interval(config.inv_update_steps)
    # every micro-batch of a factor step is captured; ``rows`` are one micro-batch's
    t.secs["capture"] *= config.accumulation_steps
    for key in ("capture", "factor_comm", "factor_fold"):
        t.secs[key] /= f
    for key in ("decompose", "inverse_comm"):
        t.secs[key] /= i
    return Forecast(
        world_size=plan.world_size,
        fraction=plan.grad_worker_fraction,
        grad_workers=plan.grad_workers,
        config={
            "factor_update_steps": f,
            "inv_update_steps": i,
            "compute_method": method,
            "symmetry_aware": sym,
            "colocate_factors": plan.colocate_factors,
        },
        memory=t.memory,
        bytes_factor_step=t.factor_step,
        bytes_inverse_step=t.inverse_step,
        bytes_every_step=t.every_step,
        seconds=t.secs,
    )


def _interval(value: int | Any) -> int:
    """An update interval; a schedule (callable of the step) is read at step 0."""
    return int(value(0)) if callable(value) else int(value)


def fractions_for(world_size: int) -> list[float]:
    """The fractions worth comparing: every allowed one up to 16 of them, else
    the powers of two between MEM-OPT (1/W) and COMM-OPT (1)."""
    allowed = allowed_fractions(world_size)
    if len(allowed) <= 16:
        return allowed
    keep = {1.0 / world_size, 1.0}
    m = 2
    while m < world_size:
        keep.add(m / world_size)
        m *= 2
    return sorted(f for f in allowed if f in keep)


def choose_fraction(
    layers: Sequence[LayerCost],
    world_size: int,
    cost: CostModel | None = None,
    memory_budget: float | None = None,
    method: CurvatureMethod | None = None,
    **kfac: Any,
) -> tuple[float, list[Forecast]]:
    """The fraction with the least predicted overhead whose K-FAC memory fits
    ``memory_budget`` bytes per rank (MEM-OPT when none fits); ties go to the
    one using less memory.  Deterministic, so every rank picks the same.
    ``method``: as :func:`forecast`'s."""
    kfac.pop("grad_worker_fraction", None)
    options = [
        forecast(layers, world_size, cost, grad_worker_fraction=f, method=method, **kfac)
        for f in fractions_for(world_size)
    ]
    fitting = [
        fc for fc in options if memory_budget is None or fc.memory["total"].max() <= memory_budget
    ]
    if not fitting:
        return options[0].fraction, options
    best = min(fitting, key=lambda fc: (round(fc.overhead().max(), 9), fc.memory["total"].max()))
    return best.fraction, options


def check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    grad_workers_for(DistributedStrategy.COMM_OPT, world_size)


def auto_fraction(
    layers: Sequence[Any],
    world_size: int,
    config: KFACConfig,
    method: CurvatureMethod | None = None,
) -> float:
    """``grad_worker_fraction='auto'``: :func:`choose_fraction` on the registered
    layers, for ``method`` (the preconditioner's own ``method=``, grafting
    applied by the forecast as by the run), with the cost model of
    ``config.plan_costs`` (the default figures when None) and
    ``config.memory_budget_mb``.  Every input is the same on
    every rank (the same file), so every rank picks the same fraction.  On
    the CPU the products' workspace counts against the budget, as
    :func:`layer_costs` counts it."""
    # the CPU workspace counts as it does in layer_costs (a CPU run holds it)
    owns = sole_owners([la.adapter for la in layers])
    costs = [
        LayerCost(
            name=la.name,
            factors=la.factors,
            grad_shape=tuple(la.adapter.matrix_shape),
            factor_itemsize=la.factor_dtype.itemsize,
            inv_itemsize=la.inv_dtype.itemsize,
            grad_itemsize=la.adapter.weight.dtype.itemsize,
            reuses_workspace=whole
            and uses_workspace(
                la.adapter.device,
                la.adapter.matrix_shape[0] * la.adapter.matrix_shape[1],
                la.adapter.weight.element_size(),
            ),
        )
        for la, whole in zip(layers, owns)
    ]
    kfac = {name: getattr(config, name) for name in KFACConfig.field_names()}
    budget = config.memory_budget_mb * 2**20 if config.memory_budget_mb is not None else None
    cost = None
    if config.plan_costs is not None:
        try:
            cost = CostModel.load(Path(config.plan_costs))
        except (OSError, ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(
                f"plan_costs={config.plan_costs!r} is not a cost model kaisa can read "
                f"(a JSON file written by `kaisa plan --save-costs`): {exc}"
            ) from exc
    chosen, _ = choose_fraction(costs, world_size, cost, budget, method, **kfac)
    return chosen
