"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

:meth:`KFACPreconditioner.state_dict` gathers every factor onto every rank —
simple, and right for small runs.  At thousands of ranks each rank should
write only what it holds and read only what it will hold.  The sharded state
dict holds, on each rank:

- the running factors the current plan makes it the owner of, each with a
  presence flag (a layer may not have been captured yet), under
  ``"<layer>.<factor>"`` in ``"factors"`` and ``"present"``: keys disjoint
  across ranks, so DCP writes each factor once, from its owner;
- the second-order tensors (eigenbases, eigenvalues, inverses, a method's
  own state) of the layers it is a gradient worker of, under
  ``"<layer>.<tensor>"`` in ``"second_order"``, each with a flag in
  ``"held"``: every worker of a layer holds the same tensors, bit for bit,
  and DCP writes each key once;
- the step count and the hyperparameters, replicated.

Loading at another world size or fraction asks for exactly what the *new*
plan gives each rank; DCP reads it wherever it was written, and the resume
is exact.  The keys are those of either layout (a layer's two factors on
one owner or on two): a worker that needs a tensor the saved layout did not
hold (eigen with the outer product keeps no eigenvalues when its factors
share an owner) has every layer's decompositions recomputed from the saved
factors at the next step, as a checkpoint without second-order tensors
(``include_second_order=False``: the factors' size only) does::

    state = {"model": model.state_dict(), "kfac": precond.sharded_state_dict()}
    dcp.save(state, checkpoint_id=path)
    ...
    state = {"model": model.state_dict(), "kfac": precond.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)      # fills the templates in place
    precond.load_sharded_state_dict(state["kfac"])

A checkpoint saved without second-order tensors loads into a template made
the same way (``sharded_state_dict(include_second_order=False)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kaisa.checkpoint.state import STATE_VERSION, check_saved_factor, check_saved_values
from kaisa.distributed.plan import WorkPlan
from kaisa.layers.state import KFACLayer

if TYPE_CHECKING:
    from kaisa.config import KFACConfig
    from kaisa.step.schedule import Schedule
    from kaisa.wiring import Parts

__all__ = [
    "owned_entries",
    "owned_factors",
    "restore_sharded",
    "sharded_state",
    "take_owned_factors",
    "worked_entries",
    "worked_second_order",
]


def sharded_state(
    parts: Parts,
    hyperparameters: dict[str, Any],
    rank: int,
    damping: float,
    include_second_order: bool,
) -> dict[str, Any]:
    """Step count and hyperparameters (replicated), the owned factors and,
    with ``include_second_order``, the worked layers' second-order tensors."""
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "steps": torch.tensor(parts.pipeline.steps),
        "hyperparameters": hyperparameters,
    }
    state.update(owned_factors(parts.layers, parts.plan, rank))
    if include_second_order:
        state.update(worked_second_order(parts, rank, damping))
    return state


def restore_sharded(
    parts: Parts, schedule: Schedule, config: KFACConfig, rank: int, state: Mapping[str, Any]
) -> None:
    """Validate, take the owned factors, agree which layers had statistics (one
    small collective) and let the owners recompute decompositions next step.

    Each rank reads only its own part of a sharded checkpoint, so only the
    owner of a damaged tensor (NaN, Inf, another dtype) can see the damage:
    every rank checks its part, the ranks agree (one small collective) and
    either all load or all raise, before anything changes on any rank.  A
    refusal on one rank alone would leave the others waiting in the next
    collective, or training on a state the refusing rank does not hold."""
    if not isinstance(state, Mapping) or "steps" not in state:
        raise ValueError("state must be a mapping made by sharded_state_dict() and dcp.load")
    steps = state["steps"]
    steps = int(steps.item()) if isinstance(steps, Tensor) else steps
    saved = state.get("hyperparameters", {})
    restore = schedule.restorable(saved)
    parts.checkpointer.validate({"steps": steps}, config, restore)
    layers = list(parts.layers.values())
    device = layers[0].adapter.device
    problem = ""
    try:
        entries = worked_entries(parts, rank, state) if "second_order" in state else None
        owned = owned_entries(parts.layers, parts.plan, rank, state)
    except ValueError as exc:
        problem = str(exc)
    if not parts.comm.agree_all([not problem], device)[0]:
        raise ValueError(
            problem
            or "another rank refused its part of the sharded K-FAC state (its error names "
            "the entry); nothing was loaded on any rank"
        )
    take_owned_factors(parts.layers, parts.plan, rank, owned)
    nobody = parts.comm.agree_all([not la.captured for la in layers], device)
    for layer, none in zip(layers, nobody):
        layer.captured = not none
    if entries is None:
        parts.pipeline.second_order.stale = True
    else:
        checkpointer = parts.checkpointer
        mine = [
            checkpointer.holds_second_order(la.name, entries[la.name])
            if la.name in entries
            else True
            for la in layers
        ]
        whole = parts.comm.agree_all(mine, device)
        for layer, has in zip(layers, whole):
            checkpointer.place_second_order(
                layer.name, entries.get(layer.name, {}), layer.captured or has
            )
        parts.pipeline.second_order.stale = any(
            la.captured and not has for la, has in zip(layers, whole)
        )
    schedule.restore(restore)
    parts.pipeline.resume_at(steps)


def owned_factors(layers: Mapping[str, KFACLayer], plan: WorkPlan, rank: int) -> dict[str, Any]:
    """``{"factors": {key: tensor}, "present": {key: 0/1 tensor}}`` for the
    factors ``rank`` owns (zeros where a factor does not exist yet)."""
    factors: dict[str, Tensor] = {}
    present: dict[str, Tensor] = {}
    for name, layer in layers.items():
        lp = plan.layer(name)
        for spec, owner, running in zip(layer.factors, lp.owners, layer.running):
            if owner != rank:
                continue
            key = f"{name}.{spec.name}"
            device = layer.adapter.device
            if running is None:
                factors[key] = torch.zeros(spec.shape, dtype=layer.factor_dtype, device=device)
            else:
                factors[key] = running.detach().clone()
            present[key] = torch.tensor(float(running is not None), device=device)
    return {"factors": factors, "present": present}


def owned_entries(
    layers: Mapping[str, KFACLayer], plan: WorkPlan, rank: int, state: Mapping[str, Any]
) -> dict[str, Tensor]:
    """The factors ``rank`` owns that a loaded :func:`owned_factors` template
    holds (those flagged present), by key, checked; nothing is changed."""
    factors, present = state.get("factors"), state.get("present")
    if not isinstance(factors, Mapping) or not isinstance(present, Mapping):
        raise ValueError("a sharded K-FAC state needs 'factors' and 'present' mappings")
    expected = {
        f"{name}.{spec.name}": spec
        for name, layer in layers.items()
        for spec, owner in zip(layer.factors, plan.layer(name).owners)
        if owner == rank
    }
    missing = sorted((set(expected) - set(factors)) | (set(expected) - set(present)))
    if missing:
        raise ValueError(f"sharded state lacks factors this rank owns: {missing}")
    owned: dict[str, Tensor] = {}
    for key, spec in expected.items():
        value = factors[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != spec.shape:
            raise ValueError(f"sharded state entry {key!r} must be a tensor of shape {spec.shape}")
        if bool(present[key]):
            check_saved_factor(f"sharded state entry {key!r}", spec, value)
            owned[key] = value
    return owned


def take_owned_factors(
    layers: Mapping[str, KFACLayer], plan: WorkPlan, rank: int, owned: Mapping[str, Tensor]
) -> None:
    """Install :func:`owned_entries`' factors; every other factor starts afresh."""
    for name, layer in layers.items():
        lp = plan.layer(name)
        captured = False
        for i, (spec, owner) in enumerate(zip(layer.factors, lp.owners)):
            layer.running[i] = None
            if owner != rank:
                continue
            value = owned.get(f"{name}.{spec.name}")
            if value is not None:
                layer.running[i] = value.to(layer.adapter.device, layer.factor_dtype)
                captured = True
        layer.state.clear()
        layer.captured = captured
        layer.decomposed = False


def worked_second_order(parts: Parts, rank: int, damping: float) -> dict[str, Any]:
    """``{"second_order": {key: tensor}, "held": {key: 0/1 tensor}}`` for the
    layers ``rank`` is a gradient worker of, keyed by either layout's
    tensors (zeros where the layer holds none).  A layer captured but not
    yet decomposed holds its damping-only stand-ins, as the gathered state
    does, unless a load left them to be recomputed at the next step."""
    tensors: dict[str, Tensor] = {}
    held: dict[str, Tensor] = {}
    checkpointer, method = parts.checkpointer, parts.checkpointer.method
    for name, layer in parts.layers.items():
        lp = parts.plan.layer(name)
        if not lp.is_grad_worker(rank):
            continue
        device = layer.adapter.device
        if layer.captured and not parts.pipeline.second_order.stale:  # see Checkpointer.gather
            like = torch.empty(0, dtype=layer.inv_dtype, device=device)
            method.fill_missing(layer, method.held(layer.factors, lp.colocated), damping, like)
        for key, shape in checkpointer.second_order_shapes(layer).items():
            value = layer.state.get(key)
            full = f"{name}.{key}"
            if value is None:
                tensors[full] = torch.zeros(shape, dtype=layer.inv_dtype, device=device)
            else:
                tensors[full] = value.detach().clone()
            held[full] = torch.tensor(float(value is not None), device=device)
    return {"second_order": tensors, "held": held}


def worked_entries(
    parts: Parts, rank: int, state: Mapping[str, Any]
) -> dict[str, dict[str, Tensor]]:
    """The second-order tensors a loaded :func:`worked_second_order` template
    holds, by layer (those ``rank`` is a gradient worker of), checked."""
    tensors, held = state.get("second_order"), state.get("held")
    if not isinstance(tensors, Mapping) or not isinstance(held, Mapping):
        raise ValueError("a sharded K-FAC state's 'second_order' needs a 'held' mapping beside it")
    entries: dict[str, dict[str, Tensor]] = {}
    for name, layer in parts.layers.items():
        if not parts.plan.layer(name).is_grad_worker(rank):
            continue
        entry: dict[str, Tensor] = {}
        for key, shape in parts.checkpointer.second_order_shapes(layer).items():
            full = f"{name}.{key}"
            value, flag = tensors.get(full), held.get(full)
            if value is None or flag is None:
                raise ValueError(
                    f"sharded state lacks second-order tensors this rank works on: {full!r}"
                )
            if not isinstance(value, Tensor) or tuple(value.shape) != shape:
                raise ValueError(f"sharded state entry {full!r} must be a tensor of shape {shape}")
            if bool(flag):
                check_saved_values(f"sharded state entry {full!r}", value)
                entry[key] = value
        entries[name] = entry
    return entries
