"""``KFACPreconditioner``: the public facade.

It validates its arguments and delegates: :mod:`kaisa.wiring` builds the
parts, :mod:`kaisa.step.pipeline` runs ``step()`` phase by phase,
:mod:`kaisa.checkpoint.state` saves and restores, :mod:`kaisa.report` reports.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import Any

import torch
from torch import nn

from kaisa.attached import Attached
from kaisa.checkpoint.facade import Checkpoints
from kaisa.compat import KfacPytorchAttributes
from kaisa.config import (
    AlgorithmConfig,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    DistributionConfig,
    FloatOrSchedule,
    Grafting,
    IntOrSchedule,
    KFACApprox,
    KFACConfig,
    LargeFactor,
    LossAverage,
    PlannerConfig,
    PrecisionConfig,
    TensorParallelMode,
    as_enum,
)
from kaisa.controls import StepControls
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.plan import WorkPlan
from kaisa.distributed.topology import Topology
from kaisa.engines import Engine, GradientAccess, OwnsTheLoop
from kaisa.layers.registry import SkippedModule
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.optimizers import as_optimizers
from kaisa.report import describe, log_registration, memory_usage
from kaisa.step.schedule import Schedule, warn_unaligned_intervals
from kaisa.step.skip import SkippedUpdates
from kaisa.wiring import build, check_runtime_arguments, configure, explained_call

__all__ = ["KFACPreconditioner"]

#: what ``grad_worker_fraction`` and ``assignment_strategy`` accept: a member,
#: its name or value, kfac-pytorch's member (and for the fraction a float)
FractionArgument = DistributedStrategy | float | str | Enum
AssignmentArgument = AssignmentStrategy | str | Enum

#: the constructor's keywords that are options of :class:`KFACConfig`
OPTION_NAMES = frozenset(KFACConfig.field_names())

logger = logging.getLogger("kaisa")


class KFACPreconditioner(Attached, KfacPytorchAttributes, Checkpoints, StepControls):
    """Distributed K-FAC gradient preconditioner.

    Construct once, then call :meth:`step` after ``loss.backward()`` and
    before ``optimizer.step()``; it rewrites the gradient of every registered
    layer with its K-FAC preconditioned (and KL-clipped) gradient and never
    touches the weights::

        precond = KFACPreconditioner(model, optimizer=optimizer)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            precond.step()
            optimizer.step()

    Keyword arguments are those of kfac-pytorch's ``KFACPreconditioner``, with
    the same names, plus kaisa's own; each is listed with its type and default
    below, grouped by concern.  The plain options become :attr:`config`, a
    :class:`kaisa.KFACConfig` (see it and the per-concern configs for their
    meaning and allowed values): enum options take a member, its value or
    name in any case (``'eigen'``, ``'MEM_OPT'``) or kfac-pytorch's member of
    the same name; dtypes take a ``torch.dtype`` or its name.  An unknown
    keyword is a ``TypeError`` naming it, a bad value a ``ValueError`` or
    ``TypeError`` naming the option and what it allows.

    Args:
        model: the model, optionally wrapped by DDP, DataParallel or
            ``torch.compile`` (layer names are those of the unwrapped model).
            Every supported layer is registered (``nn.Linear``,
            ``nn.Conv1d``/``nn.Conv2d`` with groups=1, ``nn.Embedding``,
            ``nn.MultiheadAttention``'s q/k/v/out blocks, Hugging Face's
            ``Conv1D``, a Linear head tied to an Embedding: docs/getting-started.md
            lists them) — frozen ones too, preconditioned on the steps they
            have a gradient — except those matching ``skip_layers``, those
            with a parameter tied to another module in any other way, and
            those whose weight is computed from other parameters.
        optimizer: the optimizer, or every optimizer (``[muon, adamw]``),
            stepping the model: the KL clip reads the first one's lr at every
            step unless ``lr`` is given (:mod:`kaisa.optimizers`).
        grad_scaler: a ``torch.amp.GradScaler`` or a callable returning the
            current loss scale; it is divided out of the captured output
            gradients.  Call ``scaler.unscale_(optimizer)`` before :meth:`step`
            so the KL clip sees true gradients.
        lr: the learning rate the KL clip assumes; None: the optimizer's, else
            the engine's, else 0.1.
        accumulation_steps: micro-batches per :meth:`step`; None: the
            engine's (DeepSpeed's, a pipeline schedule's), else 1.
        gradient_access: how parameter gradients are read and written
            (default: ``.grad``).
        engine: the training engine (default: chosen from the model).
        topology: the data-parallel group and model-parallel groups
            (default: the whole world is data parallel).
        pg_timeout_s: timeout of the process groups kaisa creates.
        loglevel: the level of the registration report on the ``"kaisa"`` logger.
        method: the curvature method: a :class:`kaisa.methods.CurvatureMethod`
            object (a method of one's own), or a ``compute_method`` name
            (``'eigen'``, ``'inverse'``, ``'ekfac'``, ``'ekfac_adam'``); give it or
            ``compute_method``, not both.
        grafting: ``'sgd'`` or ``'adam'``: each layer's ``V`` takes the norm of
            that method's direction of the layer's gradient
            (:mod:`kaisa.methods.grafted`); None (default): no grafting.
    """

    @explained_call
    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        grad_scaler: Any | None = None,
        # -- the algorithm (kaisa.AlgorithmConfig)
        factor_update_steps: IntOrSchedule = AlgorithmConfig.factor_update_steps,
        inv_update_steps: IntOrSchedule = AlgorithmConfig.inv_update_steps,
        damping: FloatOrSchedule = AlgorithmConfig.damping,
        factor_decay: FloatOrSchedule = AlgorithmConfig.factor_decay,
        kl_clip: FloatOrSchedule | None = AlgorithmConfig.kl_clip,
        lr: FloatOrSchedule | None = None,
        accumulation_steps: int | None = None,
        compute_method: ComputeMethod | str | Enum = AlgorithmConfig.compute_method,
        compute_eigenvalue_outer_product: bool = AlgorithmConfig.compute_eigenvalue_outer_product,
        skip_layers: str | Collection[str] | None = AlgorithmConfig.skip_layers,
        update_factors_in_hook: bool = AlgorithmConfig.update_factors_in_hook,
        loss_average: LossAverage | str = AlgorithmConfig.loss_average,
        kfac_approx: KFACApprox | str = AlgorithmConfig.kfac_approx,
        factor_position_fraction: float | None = AlgorithmConfig.factor_position_fraction,
        factor_position_seed: int | None = AlgorithmConfig.factor_position_seed,
        max_factor_dim: int | None = AlgorithmConfig.max_factor_dim,
        large_factor: LargeFactor | str = AlgorithmConfig.large_factor,
        grafting: Grafting | str | None = AlgorithmConfig.grafting,
        # -- the distribution over ranks (kaisa.DistributionConfig)
        grad_worker_fraction: FractionArgument = DistributionConfig.grad_worker_fraction,
        assignment_strategy: AssignmentArgument = DistributionConfig.assignment_strategy,
        colocate_factors: bool = DistributionConfig.colocate_factors,
        allreduce_bucket_cap_mb: float = DistributionConfig.allreduce_bucket_cap_mb,
        symmetry_aware: bool = DistributionConfig.symmetry_aware,
        tensor_parallel: TensorParallelMode | str = DistributionConfig.tensor_parallel,
        # -- precision (kaisa.PrecisionConfig)
        factor_dtype: torch.dtype | str | None = PrecisionConfig.factor_dtype,
        inv_dtype: torch.dtype | str | None = PrecisionConfig.inv_dtype,
        factor_compute_dtype: torch.dtype | str | None = PrecisionConfig.factor_compute_dtype,
        precondition_dtype: torch.dtype | str | None = PrecisionConfig.precondition_dtype,
        # -- the planner of grad_worker_fraction='auto' (kaisa.PlannerConfig)
        memory_budget_mb: float | None = PlannerConfig.memory_budget_mb,
        plan_costs: str | os.PathLike[str] | None = PlannerConfig.plan_costs,
        # -- the runtime
        gradient_access: GradientAccess | None = None,
        engine: Engine | None = None,
        topology: Topology | None = None,
        pg_timeout_s: float | None = None,
        loglevel: int = logging.DEBUG,
        method: CurvatureMethod | str | None = None,
    ) -> None:
        options = {k: v for k, v in locals().items() if k in OPTION_NAMES}
        check_runtime_arguments(
            model, optimizer, grad_scaler, gradient_access, pg_timeout_s, loglevel, topology, engine
        )
        method_object = _method_argument(method, options, AlgorithmConfig.compute_method)
        steppers = as_optimizers(optimizer)
        setup = configure(model, options, steppers, grad_scaler, gradient_access, engine, topology)
        self._schedule = Schedule(setup.config, next(iter(steppers), None), setup.lr_from_optimizer)
        self._model = model
        self._optimizer = optimizer
        self._grad_scaler = setup.grad_scaler
        warn_unaligned_intervals(setup.config)
        self._parts = build(model, setup, self._schedule, pg_timeout_s, method_object)
        engine = setup.engine
        self._attached = (
            engine.attach(self.step, self.paused) if isinstance(engine, OwnsTheLoop) else None
        )
        # after a step skipped for non-finite gradients the next update changes
        # nothing either: the optimizer given loses its gradients, or an engine
        # that steps its own keeps it still by its rule
        self._skipped_updates = SkippedUpdates(steppers, engine, self.grad_scaler is not None)
        self._parts.pipeline.verdict.keep_updates(self._skipped_updates)
        log_registration(
            logger, loglevel, repr(self), list(self.layers.values()), self.skipped, self.plan
        )
        self._warn_memory_opt_without_colocation()

    # -- the step ------------------------------------------------------------------
    def step(self) -> bool:
        """Precondition the gradients of every registered layer in place.

        Returns False where the step was skipped: a ``GradScaler`` found an
        overflow, or a registered layer's gradient held a NaN or Inf. A
        skipped step leaves kaisa's state as it was; for non-finite
        gradients, with ``optimizer=`` given, it also sets every gradient of
        the optimizer's parameters to None, so that the optimizer's next
        step changes no weight and no state (torch's optimizers skip a
        parameter without a gradient); under an engine that steps its own
        optimizer (DeepSpeed) the engine's next step is kept still
        (:mod:`kaisa.step.skip`); without either, skip ``optimizer.step()``
        yourself when this returns False.
        """
        if not self._parts.capture.active:
            raise RuntimeError("step() called after remove_hooks(); create a new preconditioner")
        # torch.no_grad() without its decorator's per-call objects (a
        # microsecond of a replayed step's few; dynamo traces this as well)
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            pipeline = self._parts.pipeline
            applied = pipeline.step()
            self._skipped_updates.after(not applied and pipeline.verdict.skipped_nonfinite)
        finally:
            torch._C._set_grad_enabled(enabled)
        return applied

    # -- configuration and state views --------------------------------------------
    @property
    def config(self) -> KFACConfig:
        return self._schedule.config

    @property
    def steps(self) -> int:
        return self._parts.pipeline.steps

    @property
    def nonfinite_steps(self) -> int:
        """Steps skipped because a registered layer's gradient held a NaN or
        Inf (a ``GradScaler``'s own skips are not counted): each left kaisa
        as it was, with its gradients unchanged (:mod:`kaisa.step.nonfinite`)."""
        return self._parts.pipeline.verdict.nonfinite.count

    @property
    def layers(self) -> dict[str, KFACLayer]:
        return self._parts.layers

    @property
    def skipped(self) -> list[SkippedModule]:
        return self._parts.skipped

    @property
    def skipped_modules(self) -> list[SkippedModule]:
        return list(self._parts.skipped)

    @property
    def plan(self) -> WorkPlan:
        return self._parts.plan

    @property
    def comm(self) -> Communicator:
        """The communicator of the data-parallel group (byte counts, timeout)."""
        return self._parts.comm

    @property
    def rank(self) -> int:
        """This process's position in the data-parallel group."""
        return self._parts.comm.rank

    @property
    def loss_items(self) -> float | None:
        """``N`` of a loss ``Σ ℓ / N`` (``loss_average='items'``): set it before
        each optimizer step's backward passes, as this rank's share of ``N``."""
        return self._parts.capture.normalisation.items

    @loss_items.setter
    def loss_items(self, value: float | int | torch.Tensor | None) -> None:
        self._parts.capture.normalisation.set_items(value)

    # -- hooks ------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        """Take every hook kaisa registered off the model (and the engine),
        and its verdict off the optimizer (:mod:`kaisa.step.skip`)."""
        self._parts.capture.remove()
        self._skipped_updates.detach()
        if self._attached is not None:
            self._attached.remove()
            self._attached = None

    def __enter__(self) -> KFACPreconditioner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove_hooks()

    @contextmanager
    def hooks_off(self) -> Iterator[None]:
        """Take kaisa's capture hooks off the model inside, and put them back
        on exit: the model's forward and backward run as without kaisa, and
        capture nothing (unlike :meth:`paused`, whose hooks still run and
        return at once), while :meth:`step` preconditions as before.  To
        measure what the idle hooks cost a non-factor step; a factor step
        inside has no new statistics to fold.  An engine's own capture hooks
        (tensor parallelism) stay."""
        capture = self._parts.capture
        if not capture.active:
            raise RuntimeError("hooks_off() after remove_hooks(): the hooks are gone")
        if capture.suspended:  # nested: the outer one puts them back
            yield
            return
        capture.suspend()
        try:
            yield
        finally:
            capture.resume()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Capture nothing inside (e.g., for an extra training-mode forward)."""
        capture = self._parts.capture
        previous = capture.enabled
        capture.enabled = False
        try:
            yield
        finally:
            capture.enabled = previous

    # -- reporting ------------------------------------------------------------------------
    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this rank: factors, batch statistics, second-order
        tensors, on CPU the buffers the products reuse (``workspace``: three
        times the largest gradient matrix, see :mod:`kaisa.core.workspace`),
        and the stacked copies of the second-order tensors of layers
        preconditioned together (``stacked``, :mod:`kaisa.step.batched`)."""
        application = self._parts.pipeline.application
        return memory_usage(
            list(self.layers.values()), application.workspace_bytes, application.groups.nbytes()
        )

    def comm_stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """Bytes and calls per collective kind: ``{'step': …, 'total': …}``."""
        return self._parts.comm.stats.as_dict()

    def describe(self) -> str:
        """Registration report: what is preconditioned, what is not, and why."""
        return describe(repr(self), list(self.layers.values()), self.skipped, self.plan)

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"KFACPreconditioner(layers={len(self.layers)}, skipped={len(self.skipped)}, "
            f"compute_method={self._parts.method.name}, "
            f"factor_update_steps={cfg.factor_update_steps}, "
            f"inv_update_steps={cfg.inv_update_steps}, "
            f"damping={cfg.damping}, factor_decay={cfg.factor_decay}, kl_clip={cfg.kl_clip}, "
            f"world_size={self.plan.world_size}, grad_workers={self.plan.grad_workers}, "
            f"steps={self.steps})"
        )


def _method_argument(
    method: Any, options: dict[str, Any], default_compute_method: Any
) -> CurvatureMethod | None:
    """``method=``: a name replaces ``compute_method`` in ``options``; an object
    is returned, its name written into ``options`` where it is a library
    method's (so ``precond.compute_method``, ``repr`` and a checkpoint's
    hyperparameters name the method that runs); with ``compute_method`` given
    too (any value but the signature's own default object, its name
    included), a ``ValueError``."""
    if method is None:
        return None
    if options["compute_method"] is not default_compute_method:  # given, even as the default
        raise ValueError(
            "give method= or compute_method=, not both; "
            f"got method={method!r}, compute_method={options['compute_method']!r}"
        )
    if isinstance(method, str | Enum):  # a name, read as compute_method= reads it
        options["compute_method"] = as_enum("method", method, ComputeMethod)
        return None
    if not isinstance(method, CurvatureMethod):
        allowed = ", ".join(repr(m.value) for m in ComputeMethod)
        raise TypeError(
            "method must be a kaisa.methods.CurvatureMethod or one of "
            f"{allowed}; got {type(method).__name__}"
        )
    if method.name in {m.value for m in ComputeMethod}:
        options["compute_method"] = ComputeMethod(method.name)
    return method
