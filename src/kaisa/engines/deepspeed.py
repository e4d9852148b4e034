"""DeepSpeed: ``KFACPreconditioner(ds_engine, ...)`` for ZeRO stages 0–3.

Call ``precond.step()`` after ``ds_engine.backward(loss)`` on the
accumulation boundary and before ``ds_engine.step()``::

    ds_engine.backward(loss)
    if ds_engine.is_gradient_accumulation_boundary():
        precond.step()
    ds_engine.step()

Where DeepSpeed keeps a gradient decides how it is read (measured with
DeepSpeed 0.19.8):

* stage 0: the averaged gradient is in ``param.grad`` on every rank;
* stages 1 and 2 (and the bf16 optimizer): ``param.grad`` is None; each rank
  holds a *fragment* of the averaged gradient, the part of its optimizer
  partition that falls in the parameter;
* stage 3: each rank holds a contiguous *partition* of the zero-padded,
  flattened gradient; ``param.shape`` is ``(0,)`` outside forward and
  ``param.ds_shape`` is the real shape.

``deepspeed.utils.safe_get_full_grad`` assembles a full gradient on every
rank, one collective per parameter.  Only a layer's gradient workers need it,
so this engine assembles the gradients of all layers with the same workers
in one collective and sends them to those workers only: a ``reduce`` of the
fragments (stages 1/2) or a ``gather`` of the partitions (stage 3) where a
layer has one worker (MEM-OPT), an all-reduce or all-gather where every rank
is a worker (COMM-OPT).  Writing back is local: every rank holds the
preconditioned gradient after kaisa's broadcast and keeps its own part.

DeepSpeed divides the loss by ``gradient_accumulation_steps`` and owns the
learning rate, so both come from the engine.  Its ``gradient_clipping``
(default 1.0) clips *after* kaisa, on top of the KL clip: see docs/frameworks.md.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import Tensor, nn

from kaisa.distributed import collectives
from kaisa.distributed.topology import Topology
from kaisa.engines.base import (
    Engine,
    EngineDefaults,
    OwnsTheLoop,
    ShardedReads,
    assemble_by_workers,
    unique_parameters,
)
from kaisa.engines.pytorch import unwrap_model
from kaisa.layers.base import LayerAdapter, param_shape
from kaisa.step.skip import take_gradients

__all__ = ["DeepSpeedEngine", "is_deepspeed_engine"]


def _is_a(obj: Any, class_name: str) -> bool:
    return any(
        c.__module__.startswith("deepspeed.") and c.__name__ == class_name
        for c in type(obj).__mro__
    )


def is_deepspeed_engine(model: Any) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine`` (without importing DeepSpeed)."""
    return _is_a(model, "DeepSpeedEngine")


class Layout(enum.Enum):
    """Where DeepSpeed keeps one parameter's averaged gradient."""

    GRAD = "param.grad"  # stage 0
    FRAGMENT = "fragment"  # stages 1/2, bf16 optimizer
    PARTITION = "partition"  # stage 3


def layout_of(param: nn.Parameter) -> Layout | None:
    if getattr(param, "_hp_grad", None) is not None:
        return Layout.FRAGMENT
    if param.grad is not None:
        return Layout.GRAD
    if hasattr(param, "ds_id"):
        return Layout.PARTITION
    if hasattr(param, "_hp_mapping"):
        return Layout.FRAGMENT
    return None


class DeepSpeedEngine(Engine, ShardedReads, OwnsTheLoop):
    """Gradients of a ``deepspeed.DeepSpeedEngine`` (ZeRO 0–3, fp32/bf16/fp16)."""

    name = "deepspeed"

    def __init__(self, ds_engine: Any) -> None:
        if not is_deepspeed_engine(ds_engine):
            raise TypeError(
                f"DeepSpeedEngine needs a deepspeed.DeepSpeedEngine; got {type(ds_engine).__name__}"
            )
        self._ds = weakref.ref(ds_engine)
        self.fp16 = bool(ds_engine.fp16_enabled())
        self.stage = int(ds_engine.zero_optimization_stage())
        self.pipeline = _is_a(ds_engine, "PipelineEngine")

    @property
    def ds(self) -> Any:
        ds = self._ds()
        if ds is None:
            raise RuntimeError("kaisa: the DeepSpeed engine this preconditioner wraps is gone")
        return ds

    # -- what the engine knows ------------------------------------------------------
    def defaults(self) -> EngineDefaults:
        ds = self.ds

        def lr(step: int) -> float:
            return float(ds.get_lr()[0])

        topology: Topology | None = None
        if self.pipeline:
            # a stage preconditions its own layers with its data-parallel
            # peers; the KL clip sums over the stages
            grid = ds.grid
            topology = Topology(
                dp=grid.get_data_parallel_group(), pp=grid.get_pipe_parallel_group()
            )
        else:
            group = ds.data_parallel_group
            if group is not None:
                topology = Topology(dp=group)
        return EngineDefaults(
            accumulation_steps=int(ds.gradient_accumulation_steps()),
            lr=lr,
            topology=topology,
            loss_scale=self._loss_scale if self.fp16 else None,
        )

    def attach(
        self, step: Callable[[], object], paused: Callable[[], AbstractContextManager[None]]
    ) -> Any:
        """The pipeline engine runs forward, backward, the gradient all-reduce
        and the optimizer step inside ``train_batch()``; the one point between
        the all-reduce and the update is the client optimizer's step pre-hook."""
        if not self.pipeline:
            return None
        optimizer = self.ds.optimizer
        register = getattr(optimizer, "register_step_pre_hook", None)
        if register is None:
            raise ValueError(
                "kaisa needs a torch.optim.Optimizer inside DeepSpeed's pipeline engine (ZeRO "
                f"stage 0, no DeepSpeed optimizer wrapper); got {type(optimizer).__name__}"
            )

        def before_update(*_: Any) -> None:
            step()

        return register(before_update)

    def _loss_scale(self) -> float:
        return float(self.ds.optimizer.loss_scale)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return unwrap_model(self.ds.module)

    def check_step(self) -> None:
        ds = self.ds
        if not ds.is_gradient_accumulation_boundary():
            raise RuntimeError(
                "kaisa: precond.step() called off the gradient-accumulation boundary: call it "
                "only when ds_engine.is_gradient_accumulation_boundary() is True (after "
                "ds_engine.backward(loss), before ds_engine.step())"
            )

    def skips_update(self) -> str:
        if self._plain_optimizer() is not None:
            return (
                "the gradients of DeepSpeed's optimizer were taken away and its step marked "
                "as an overflow, so engine.step() changes no weight and no state and counts "
                "the step in engine.skipped_steps"
            )
        return (
            "DeepSpeed's optimizer finds the non-finite gradients itself and skips its "
            "update (engine.skipped_steps counts it)"
        )

    def mark_update(self, skipped: bool) -> None:
        """ZeRO's optimizers and DeepSpeed's fp16/bf16 wrappers check the
        gradients and skip a non-finite update themselves (counted in
        ``skipped_steps``, the lr scheduler not stepped).  A plain torch
        optimizer (ZeRO 0 in fp32; the pipeline engine) checks nothing: kaisa
        takes its gradients away and sets the ``overflow`` flag the engine
        reads after the update, so the step counts as one DeepSpeed skipped."""
        optimizer = self._plain_optimizer()
        if optimizer is None:
            return
        if skipped:
            take_gradients(optimizer)
            optimizer.overflow = True  # type: ignore[attr-defined]
        elif getattr(optimizer, "overflow", False):
            optimizer.overflow = False  # type: ignore[attr-defined]

    def _plain_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer ``engine.step()`` runs, where it is a torch optimizer
        rather than one of DeepSpeed's wrappers."""
        optimizer = self.ds.optimizer
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    def step_is_valid(self) -> bool | Tensor:
        """Under fp16 DeepSpeed skips a step whose scaled gradients overflowed
        (and lowers the scale); kaisa must skip it too.  Each rank checks the
        part it holds; the pipeline agrees over the ranks."""
        if not self.fp16:
            return True
        held = [t for p in self.ds.module.parameters() if (t := _local_part(p)) is not None]
        if not held:
            return True
        return torch.stack([torch.isfinite(t).all() for t in held]).all()

    def gradient_marks(self, adapters: Sequence[LayerAdapter]) -> list[Any]:
        # DeepSpeed counts micro-steps in ds_engine.step() and optimizer steps
        # (train_batch); kaisa steps once before each, so unchanged counts
        # mean no backward since the last step()
        mark = (self._ds, (self.ds.global_steps, self.ds.micro_steps))
        return [mark for _ in adapters]

    # -- reading ---------------------------------------------------------------------
    def present(self, adapter: LayerAdapter) -> bool:
        weight = adapter.weight
        if not weight.requires_grad:
            return False
        return layout_of(weight) is not None

    def local_gradients(self, adapters: Sequence[LayerAdapter]) -> list[Tensor]:
        parts = (_local_part(p) for p in unique_parameters(adapters))
        return [t for t in parts if t is not None]

    def gradients_agree(self) -> bool:
        # ZeRO ≥ 1 keeps a (zero where unused) gradient for every trainable
        # parameter; stage 0 all-reduces only the gradients that exist
        return self.stage >= 1

    def gradient_dtype(self, adapter: LayerAdapter) -> torch.dtype:
        weight = adapter.weight
        if layout_of(weight) is Layout.GRAD:
            assert weight.grad is not None
            return weight.grad.dtype
        return torch.float32

    def read(self, adapter: LayerAdapter) -> Tensor | None:
        if not self.present(adapter):
            return None
        return self.read_many([adapter], [tuple(range(collectives.world_size()))])[0]

    def read_many(
        self, adapters: Sequence[LayerAdapter], workers: Sequence[Sequence[int]]
    ) -> list[Tensor | None]:
        # stage 0 keeps full gradients on every rank: nothing to assemble
        held = [layout_of(a.weight) is Layout.GRAD for a in adapters]
        shared = [a for a, h in zip(adapters, held) if not h]
        fulls = iter(
            assemble_by_workers(shared, [w for w, h in zip(workers, held) if not h], _assemble)
        )
        out: list[Tensor | None] = []
        for adapter, local in zip(adapters, held):
            full = [p.grad for p in adapter.parameters()] if local else next(fulls)
            out.append(None if full is None else self._matrix(adapter, full))
        return out

    def _matrix(self, adapter: LayerAdapter, full: Sequence[Tensor | None]) -> Tensor:
        matrix = adapter.matrix_of(full)
        assert matrix is not None
        if self.fp16:  # DeepSpeed unscales inside ds_engine.step(), after kaisa
            matrix = matrix / self._loss_scale()
        return matrix

    # -- writing ---------------------------------------------------------------------
    def write(self, adapter: LayerAdapter, matrix: Tensor) -> None:
        if self.fp16:
            matrix = matrix * self._loss_scale()
        weight, bias = adapter.matrix_to_grads(matrix)
        values = [weight] if bias is None else [weight, bias]
        for param, rows, value in zip(adapter.parameters(), adapter.param_rows(), values):
            start = 0
            if rows is not None:  # rows of a tensor shared by several layers
                start = (rows.start or 0) * (param_shape(param).numel() // param_shape(param)[0])
            _write(param, value.reshape(-1), start)


def _group_of(param: nn.Parameter, layout: Layout) -> Any:
    if layout is Layout.PARTITION:
        return getattr(param, "ds_process_group", None)
    return getattr(param, "_dp_group", None)


def _fragment(param: nn.Parameter) -> tuple[Tensor, int] | None:
    """This rank's part of a ZeRO-1/2 gradient and its offset in the flat parameter."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    frag = (
        mapping.get_lp_grad_fragment(cast(Any, param)._index_in_param_group)
        .to(torch.float32)
        .flatten()
    )
    address = mapping.lp_fragment_address
    if frag.numel() == param.numel() and frag.numel() != address.numel:
        # the bf16 optimizer keeps the whole accumulation buffer on each rank
        frag = frag.narrow(0, address.start, address.numel)
    return frag, int(address.start)


def _local_part(param: nn.Parameter) -> Tensor | None:
    """The part of the averaged gradient this rank holds, if any."""
    layout = layout_of(param) if param.requires_grad else None
    if layout is Layout.GRAD:
        return param.grad
    if layout is Layout.PARTITION:
        from deepspeed.utils import safe_get_local_grad

        return cast("Tensor | None", safe_get_local_grad(param))
    if layout is Layout.FRAGMENT:
        found = _fragment(param)
        return found[0] if found is not None else None
    return None


def _assemble(params: list[nn.Parameter], ranks: tuple[int, ...]) -> list[Tensor] | None:
    """Full fp32 gradients of ``params`` on ``ranks`` (None elsewhere): one collective."""
    layout = layout_of(params[0])
    group = _group_of(params[0], layout or Layout.FRAGMENT)
    if layout is Layout.PARTITION:
        from deepspeed.utils import safe_get_local_grad

        parts = [safe_get_local_grad(p).to(torch.float32).flatten() for p in params]
        local = torch.cat(parts)
        rows = collectives.gather_onto(local, ranks, group)
        if rows is None:
            return None
        out, at = [], 0
        for p, part in zip(params, parts):
            whole = rows[:, at : at + part.numel()].reshape(-1)[: param_shape(p).numel()]
            out.append(whole.reshape(param_shape(p)))
            at += part.numel()
        return out
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=params[0].device)
    at = 0
    for p, n in zip(params, sizes):
        found = _fragment(p)
        if found is not None:
            frag, start = found
            flat.narrow(0, at + start, frag.numel()).copy_(frag)
        at += n
    if not collectives.sum_onto(flat, ranks, group):
        return None
    return [t.view(p.shape) for t, p in zip(flat.split(sizes), params)]


def _write(param: nn.Parameter, flat: Tensor, start: int) -> None:
    """Write ``flat`` at ``[start, start + len)`` of the flattened gradient,
    into whatever part of it this rank holds (no communication)."""
    layout = layout_of(param)
    if layout is Layout.GRAD:
        assert param.grad is not None
        param.grad.view(-1).narrow(0, start, flat.numel()).copy_(flat)
        return
    if layout is Layout.PARTITION:
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        mine = safe_get_local_grad(param).to(torch.float32).flatten().clone()
        offset = collectives.rank(_group_of(param, layout)) * mine.numel()
    elif layout is Layout.FRAGMENT:
        found = _fragment(param)
        if found is None:
            return
        part, offset = found
        mine = part.clone()
    else:
        return
    lo, hi = max(start, offset), min(start + flat.numel(), offset + mine.numel())
    if hi > lo:
        mine[lo - offset : hi - offset] = flat[lo - start : hi - start].to(mine.dtype)
    if layout is Layout.PARTITION:
        safe_set_local_grad(param, mine)
    else:
        _set_fragment(param, mine)


def _set_fragment(param: nn.Parameter, value: Tensor) -> None:
    mapping = cast(Any, param)._hp_mapping
    index = cast(Any, param)._index_in_param_group
    target = mapping.get_lp_grad_fragment(index)
    address = mapping.lp_fragment_address
    if target.numel() == param.numel() and target.numel() != address.numel:
        target = target.view(-1).narrow(0, address.start, address.numel)
    target.copy_(value.reshape(target.shape).to(target.dtype))
