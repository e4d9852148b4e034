"""``torch.distributed.pipelining``: one stage of a ``ScheduleGPipe`` or
``Schedule1F1B`` preconditions its own layers::

    stage = PipelineStage(submod, stage_index, num_stages, device, group=pp_group)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    precond = KFACPreconditioner(
        stage.submod, optimizer=optimizer, engine=PipeliningEngine(schedule, dp=dp_group)
    )
    for x, y in loader:
        optimizer.zero_grad()
        schedule.step(x, target=y)        # (inputs on the first stage, targets on the last)
        average_over(dp_group)            # or an FSDP2 (or, shapes given, DDP) stage module
        precond.step()
        optimizer.step()

What the schedule decides, and so what this engine tells kaisa:

* **Micro-batches are accumulation steps.**  ``n_microbatches`` is kaisa's
  ``accumulation_steps``; a different ``accumulation_steps`` is refused.
* **Each micro-batch's loss is not divided.**  The schedule calls ``loss_fn``
  on every micro-batch and backpropagates it as it is; with ``scale_grads``
  (the default) it divides the accumulated parameter gradients by
  ``n_microbatches`` after the last backward.  The output gradients kaisa's
  hooks see are therefore those of undivided losses, so G's multiplier must
  not include the micro-batch count (``loss_divisor=1``).  ``scale_grads``
  itself only scales the gradients kaisa reads after the schedule step, so G
  is exact either way; ``loss_fn`` must not divide by ``n_microbatches``.
* **The first ``step()`` runs an extra forward and backward** to infer the
  shapes sent between stages (torch ≥ 2.13: ``_forward_metadata_inference``
  and ``_backward_metadata_inference``, on the first stage's real inputs and
  on *empty* tensors on later stages, under grad mode).  Captured, it would
  add uninitialised memory to G, one pass too many and a forward with no
  backward; the engine runs the stage's two ``_prepare_*_infra`` methods
  inside ``precond.paused()``.
* **Topology.**  A stage holds its own layers; its data-parallel peers (the
  ranks holding the same stage) are its K-FAC group, and the KL clip sums
  over the pipeline group: ``Topology(dp=<this stage's dp group>,
  pp=<the schedule's pipeline group>)``.

Gradients live where the stage module keeps them (``param.grad``, DDP, or
FSDP2's row shards): reading and writing is delegated to the engine
:func:`~kaisa.engines.select_engine` picks for the stage module.  (A DDP stage
module breaks inside torch 2.13's own shape inference, kaisa or not; given
``input_args``/``output_args`` the schedule runs none and DDP works.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from kaisa.distributed import collectives
from kaisa.distributed.schedules import is_pipeline_schedule, is_single_stage_schedule
from kaisa.distributed.tensors import fsdp_mesh, mesh_group
from kaisa.distributed.topology import Topology
from kaisa.engines.base import Engine, EngineDefaults, OwnsTheLoop, ShardedReads
from kaisa.engines.pytorch import GradientAccess, unwrap_model
from kaisa.layers.base import LayerAdapter

__all__ = ["PipeliningEngine", "is_pipeline_schedule"]

#: the stage methods that run shape inference (a forward and a backward)
_INFERENCE_METHODS = ("_prepare_forward_infra", "_prepare_backward_infra")


def _stage_of(schedule: Any) -> Any:
    """The one stage a single-stage schedule runs on this rank; a clear error otherwise."""
    if not is_pipeline_schedule(schedule):
        raise TypeError(
            "PipeliningEngine needs a torch.distributed.pipelining schedule (ScheduleGPipe, "
            f"Schedule1F1B); got {type(schedule).__name__}"
        )
    if not is_single_stage_schedule(schedule):
        raise NotImplementedError(
            f"kaisa supports single-stage pipelining schedules (ScheduleGPipe, Schedule1F1B); "
            f"{type(schedule).__name__} runs several stages per rank or splits the backward "
            "pass (not yet)"
        )
    if not getattr(schedule, "_has_backward", True):
        raise ValueError(
            "the schedule has no loss_fn, so it runs no backward pass: nothing to precondition"
        )
    stage = schedule._stage
    missing = [m for m in _INFERENCE_METHODS if not callable(getattr(stage, m, None))]
    if missing:  # pragma: no cover - a torch whose stage API changed
        raise NotImplementedError(
            f"this torch's {type(stage).__name__} has no {', '.join(missing)}: kaisa cannot "
            "keep the schedule's shape inference out of the factors"
        )
    return stage


def _ranks(group: Any) -> tuple[int, ...]:
    return collectives.group_ranks(group)


def _as_group(dp: Any) -> Any:
    """A process group from a group or a one-dimensional ``DeviceMesh``."""
    if hasattr(dp, "get_group") and hasattr(dp, "ndim"):
        if dp.ndim != 1:
            raise ValueError(
                f"dp must be a one-dimensional DeviceMesh (e.g. mesh['dp']); got {dp.ndim} dims"
            )
        return mesh_group(dp)
    if not callable(getattr(dp, "size", None)):
        raise TypeError(
            "dp must be a torch.distributed ProcessGroup, a one-dimensional DeviceMesh or None; "
            f"got {type(dp).__name__}"
        )
    return dp


class _Guard:
    """Runs a stage's shape-inference methods inside ``paused()``; ``remove()``
    puts back what the stage had before (its own methods, or another guard)."""

    def __init__(self, stage: Any, paused: Callable[[], AbstractContextManager[None]]) -> None:
        self.stage = stage
        self.before = {name: vars(stage).get(name) for name in _INFERENCE_METHODS}
        for name in _INFERENCE_METHODS:
            setattr(stage, name, self._paused(getattr(stage, name), paused))

    @staticmethod
    def _paused(
        method: Callable[..., Any], paused: Callable[[], AbstractContextManager[None]]
    ) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with paused():
                return method(*args, **kwargs)

        return run

    def remove(self) -> None:
        for name, before in self.before.items():
            if before is None:
                vars(self.stage).pop(name, None)  # the class's method again
            else:
                setattr(self.stage, name, before)


class PipeliningEngine(Engine, ShardedReads, OwnsTheLoop):
    """One stage of a ``torch.distributed.pipelining`` single-stage schedule.

    Args:
        schedule: a ``ScheduleGPipe`` or ``Schedule1F1B`` (with a ``loss_fn``).
        dp: this stage's data-parallel group (the ranks holding the same
            stage), as a process group or a one-dimensional ``DeviceMesh``
            (``mesh["dp"]``).  ``None``: the group of a DDP-wrapped stage
            module or the mesh of an FSDP2-sharded one; or, where the pipeline
            group is the whole world, this rank alone.
        gradient_access: how parameter gradients are read and written (as for
            :class:`~kaisa.engines.TorchEngine`).
    """

    name = "pipelining"

    def __init__(
        self, schedule: Any, *, dp: Any = None, gradient_access: GradientAccess | None = None
    ) -> None:
        from kaisa.engines import select_engine

        self.schedule = schedule
        self.stage = _stage_of(schedule)
        self.inner = select_engine(self.stage.submod, gradient_access)
        #: the stage module's engine where it partitions its gradients (FSDP2)
        self._sharded = self.inner if isinstance(self.inner, ShardedReads) else None
        self._dp = None if dp is None else _as_group(dp)
        #: the data-parallel DeviceMesh, where there is one: kaisa's worker and
        #: receiver groups are then unflattened from it (see Topology.from_mesh)
        self._dp_mesh = dp if dp is not None and hasattr(dp, "get_group") else None

    @property
    def n_microbatches(self) -> int:
        return int(self.schedule._n_microbatches)

    @property
    def num_stages(self) -> int:
        return int(self.stage.num_stages)

    def _pp_group(self) -> Any:
        return self.stage.group if self.stage.group is not None else collectives.world_group()

    def _dp_group(self) -> Any:
        """The data-parallel group: given, DDP's, FSDP2's mesh, or this rank
        alone when every rank of the world is a different stage; None when it
        cannot be known."""
        if self._dp is None:
            submod = self.stage.submod
            if isinstance(submod, nn.parallel.DistributedDataParallel):
                self._dp = submod.process_group
            elif (mesh := fsdp_mesh(submod)) is not None:
                self._dp, self._dp_mesh = mesh_group(mesh), mesh
            elif len(_ranks(self._pp_group())) == collectives.world_size():
                self._dp = collectives.solo_group()
        return self._dp

    # -- what the schedule knows --------------------------------------------------------
    def defaults(self) -> EngineDefaults:
        dp = self._dp_group()
        pp = self._pp_group() if self.num_stages > 1 else None
        return EngineDefaults(
            accumulation_steps=self.n_microbatches,
            topology=None if dp is None else Topology(dp=dp, pp=pp, dp_mesh=self._dp_mesh),
            loss_divisor=1,
        )

    def check_topology(self, topology: Any) -> None:
        """Each stage's K-FAC group holds that stage only, and the KL clip sums
        over all stages: otherwise the plan would mix layers of different
        stages, or each stage would clip its update alone."""
        stages = set(_ranks(self._pp_group()))
        if topology is None and self.num_stages > 1:
            raise ValueError(
                "PipeliningEngine: the pipeline group is smaller than the world, so other ranks "
                "hold replicas of the stages: pass dp=<this stage's data-parallel group> (e.g. "
                "mesh['dp'] of init_device_mesh(..., mesh_dim_names=('dp', 'pp')))"
            )
        if self.num_stages > 1:
            pp = topology.pp
            if pp is None or set(_ranks(pp)) != stages:
                raise ValueError(
                    f"a pipeline of {self.num_stages} stages: the KL clip must sum over the "
                    f"schedule's pipeline group (ranks {sorted(stages)}); pass topology="
                    "Topology(dp=<this stage's data-parallel group>, pp=<that group>) or leave "
                    "topology out"
                )
        me = collectives.rank()
        dp = None if topology is None else topology.dp
        dp_ranks = _ranks(dp) if dp is not None else tuple(range(collectives.world_size()))
        if set(dp_ranks) & stages != {me}:
            raise ValueError(
                f"the data-parallel group {list(dp_ranks)} holds other stages of this pipeline "
                f"(ranks {sorted(stages - {me})}); it must hold the ranks that run the same "
                "stage as this one"
            )

    def attach(
        self, step: Callable[[], object], paused: Callable[[], AbstractContextManager[None]]
    ) -> Any:
        return _Guard(self.stage, paused)

    # -- the stage module's gradients ---------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        if unwrap_model(model) is not unwrap_model(self.stage.submod):
            raise ValueError(
                "PipeliningEngine: precondition the schedule's stage module: "
                "KFACPreconditioner(stage.submod, engine=PipeliningEngine(schedule, ...))"
            )
        return self.inner.unwrap(model)

    def gradients_agree(self) -> bool:
        return self.inner.gradients_agree()

    def present(self, adapter: LayerAdapter) -> bool:
        return self.inner.present(adapter)

    def read(self, adapter: LayerAdapter) -> Tensor | None:
        return self.inner.read(adapter)

    def read_many(
        self, adapters: Sequence[LayerAdapter], workers: Sequence[Sequence[int]]
    ) -> list[Tensor | None]:
        if self._sharded is not None:
            return self._sharded.read_many(adapters, workers)
        return [self.inner.read(a) for a in adapters]

    def gradient_dtype(self, adapter: LayerAdapter) -> torch.dtype:
        if self._sharded is not None:
            return self._sharded.gradient_dtype(adapter)
        return adapter.weight.dtype

    def local_gradients(self, adapters: Sequence[LayerAdapter]) -> list[Tensor]:
        return self.inner.local_gradients(adapters)

    def write(self, adapter: LayerAdapter, matrix: Tensor) -> None:
        self.inner.write(adapter, matrix)

    def step_is_valid(self) -> bool | Tensor:
        return self.inner.step_is_valid()

    def gradient_marks(self, adapters: Sequence[LayerAdapter]) -> Iterable[Any]:
        return self.inner.gradient_marks(adapters)
