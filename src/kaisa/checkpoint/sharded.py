"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

:meth:`KFACPreconditioner.state_dict` gathers every factor onto every rank —
simple, and right for small runs.  At thousands of ranks each rank should
write only what it owns and read only what it will own.  The sharded state
dict holds, on each rank, the running factors the current plan makes it the
owner of, each with a presence flag (a layer may not have been captured
yet), under the key ``"<layer>.<factor>"``; the step count and the
hyperparameters are replicated.  Keys are disjoint across ranks, so DCP
writes each factor once, from its owner.  Loading at another world size or
fraction asks for exactly the factors the *new* plan gives this rank; DCP
reads them wherever they were written.  Eigenbases/inverses are not stored:
the new owners recompute them at the next step::

    state = {"model": model.state_dict(), "kfac": precond.sharded_state_dict()}
    dcp.save(state, checkpoint_id=path)
    ...
    state = {"model": model.state_dict(), "kfac": precond.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)      # fills the templates in place
    precond.load_sharded_state_dict(state["kfac"])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kaisa.checkpoint.state import STATE_VERSION
from kaisa.distributed.plan import WorkPlan
from kaisa.layers.state import KFACLayer

if TYPE_CHECKING:
    from kaisa.config import KFACConfig
    from kaisa.step.schedule import Schedule
    from kaisa.wiring import Parts

__all__ = ["load_owned_factors", "owned_factors", "restore_sharded", "sharded_state"]


def sharded_state(parts: Parts, config: KFACConfig, rank: int) -> dict[str, Any]:
    """Step count and hyperparameters (replicated) and the owned factors."""
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "steps": torch.tensor(parts.pipeline.steps),
        "hyperparameters": config.hyperparameters(),
    }
    state.update(owned_factors(parts.layers, parts.plan, rank))
    return state


def restore_sharded(
    parts: Parts, schedule: Schedule, config: KFACConfig, rank: int, state: Mapping[str, Any]
) -> None:
    """Validate, take the owned factors, agree which layers had statistics (one
    small collective) and let the owners recompute decompositions next step."""
    if not isinstance(state, Mapping) or "steps" not in state:
        raise ValueError("state must be a mapping made by sharded_state_dict() and dcp.load")
    steps = state["steps"]
    steps = int(steps.item()) if isinstance(steps, Tensor) else steps
    saved = state.get("hyperparameters", {})
    restore = schedule.restorable(saved if isinstance(saved, Mapping) else {})
    parts.checkpointer.validate({"steps": steps}, config, restore)
    load_owned_factors(parts.layers, parts.plan, rank, state)
    layers = list(parts.layers.values())
    nobody = parts.comm.agree_all([not la.captured for la in layers], layers[0].adapter.device)
    for layer, none in zip(layers, nobody):
        layer.captured = not none
    parts.pipeline.second_order.stale = True
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


def load_owned_factors(
    layers: Mapping[str, KFACLayer], plan: WorkPlan, rank: int, state: Mapping[str, Any]
) -> None:
    """Take the owned factors out of a loaded :func:`owned_factors` template."""
    factors, present = state.get("factors"), state.get("present")
    if not isinstance(factors, Mapping) or not isinstance(present, Mapping):
        raise ValueError("a sharded K-FAC state needs 'factors' and 'present' mappings")
    expected = {
        f"{name}.{spec.name}": spec.shape
        for name, layer in layers.items()
        for spec, owner in zip(layer.factors, plan.layer(name).owners)
        if owner == rank
    }
    missing = sorted((set(expected) - set(factors)) | (set(expected) - set(present)))
    if missing:
        raise ValueError(f"sharded state lacks factors this rank owns: {missing}")
    for key, shape in expected.items():
        value = factors[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            raise ValueError(f"sharded state entry {key!r} must be a tensor of shape {shape}")
    for name, layer in layers.items():
        lp = plan.layer(name)
        captured = False
        for i, (spec, owner) in enumerate(zip(layer.factors, lp.owners)):
            layer.running[i] = None
            if owner != rank:
                continue
            key = f"{name}.{spec.name}"
            if bool(present[key]):
                layer.running[i] = factors[key].to(layer.adapter.device, layer.factor_dtype)
                captured = True
        layer.state.clear()
        layer.captured = captured
        layer.decomposed = False
