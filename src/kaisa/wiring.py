"""Builds a preconditioner's parts from a model and its options.

Wiring is kept apart from the step loop (as kfac-pytorch keeps
``preconditioner.py`` apart from ``base_preconditioner.py``): this module
checks the runtime arguments, unwraps the model through the engine, registers
layers, fixes the dtype policy, makes the work plan over the topology's
data-parallel group, creates the communicator, the hooks and the phases,
and hands them to :class:`kaisa.step.pipeline.StepPipeline`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec

import torch
from torch import nn

from kaisa.checkpoint.state import Checkpointer
from kaisa.config import (
    DistributedStrategy,
    KFACApprox,
    KFACConfig,
    layer_dtypes,
)
from kaisa.core.positions import PositionSampler
from kaisa.core.specs import FactorSource
from kaisa.distributed.communicator import Communicator, group_ranks
from kaisa.distributed.plan import LayerSpec, WorkPlan, make_plan
from kaisa.distributed.topology import Topology
from kaisa.engines import Engine, GradientAccess, ModelParallelLayers, OwnsTheLoop, select_engine
from kaisa.layers.registry import SkippedModule, register_layers, supported_layers
from kaisa.layers.state import KFACLayer
from kaisa.methods import CurvatureMethod, resolve_method
from kaisa.methods.capabilities import updates_state
from kaisa.optimizers import as_optimizers, warn_unstepped
from kaisa.planner.forecast import auto_fraction
from kaisa.report import changes, warn_user
from kaisa.step.apply import GradientApplication
from kaisa.step.capture.calls import Capture
from kaisa.step.loss_scaling import LossScaling
from kaisa.step.pipeline import StepPipeline
from kaisa.step.reduce import FactorReduction
from kaisa.step.schedule import Schedule
from kaisa.step.second_order import SecondOrderUpdate

__all__ = [
    "Parts",
    "Setup",
    "build",
    "check_method_options",
    "check_method_plan",
    "check_runtime_arguments",
    "configure",
]


@dataclass
class Parts:
    """Everything a :class:`~kaisa.KFACPreconditioner` delegates to."""

    engine: Engine
    layers: dict[str, KFACLayer]
    skipped: list[SkippedModule]
    plan: WorkPlan
    comm: Communicator
    method: CurvatureMethod
    capture: Capture
    pipeline: StepPipeline
    checkpointer: Checkpointer


@dataclass(frozen=True)
class Setup:
    """The options in force: the user's, completed by what the engine owns."""

    config: KFACConfig
    engine: Engine
    topology: Topology | None
    #: the user's grad scaler, else the engine's loss scale (DeepSpeed fp16)
    grad_scaler: Any
    scaling: LossScaling
    #: the KL clip's lr is read from the optimizer at every step
    lr_from_optimizer: bool
    loss_divisor: int | None


def configure(
    model: nn.Module,
    options: dict[str, Any],
    optimizers: tuple[torch.optim.Optimizer, ...],
    grad_scaler: Any,
    gradient_access: GradientAccess | None,
    engine: Engine | None,
    topology: Topology | None,
) -> Setup:
    """Choose the engine and complete ``options`` (the constructor's plain
    keywords) with what it owns: the accumulation steps, the lr, the topology
    and the loss scale.  ``lr``/``accumulation_steps`` None: not given."""
    engine = engine or select_engine(model, gradient_access)
    given = engine.defaults()
    options = {k: v for k, v in options.items() if v is not None or k not in _ENGINE_OWNED}
    if given.accumulation_steps is not None:
        asked = options.setdefault("accumulation_steps", given.accumulation_steps)
        if asked != given.accumulation_steps:
            raise ValueError(
                f"accumulation_steps={asked!r} but the {engine.name} engine accumulates "
                f"{given.accumulation_steps} micro-batches per step; leave "
                "accumulation_steps out"
            )
    lr_from_optimizer = "lr" not in options and bool(optimizers)
    if "lr" not in options and not optimizers and given.lr is not None:
        options["lr"] = given.lr
    config = KFACConfig.from_options(**options)
    if "lr" not in options and not optimizers and config.kl_clip is not None:
        warn_user(
            f"kaisa: the KL clip assumes a learning rate of {config.lr:g}, kfac-pytorch's "
            "default, because neither optimizer= nor lr= was given; pass optimizer=your "
            "optimizer (its lr is then read at every step, schedules included) or lr=, or "
            "kl_clip=None to turn the clip off",
        )
    topology = topology or given.topology
    if isinstance(engine, OwnsTheLoop):
        engine.check_topology(topology)
    else:  # the user steps the optimizers: a skipped step must reach every one
        unstepped = warn_unstepped(model, optimizers)
        if unstepped is not None:
            warn_user(unstepped)
    if grad_scaler is None and given.loss_scale is not None:
        grad_scaler = given.loss_scale
    scaling = LossScaling(grad_scaler, optimizers)
    return Setup(
        config, engine, topology, grad_scaler, scaling, lr_from_optimizer, given.loss_divisor
    )


P = ParamSpec("P")

#: options whose None means "not given": the engine's value, else the default
_ENGINE_OWNED = ("lr", "accumulation_steps")


def explained_call(init: Callable[P, None]) -> Callable[P, None]:
    """``init``, whose calls it cannot take raise a ``TypeError`` that says how to fix them.

    Python's own (``unexpected keyword argument``, ``takes 2 positional
    arguments but 3 were given``) names neither the nearest option nor the way
    out; a user moving from another library meets both first. The signature
    stays ``init``'s for type checkers, IDEs and ``inspect``."""

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            inspect.signature(init).bind(*args, **kwargs)
        except TypeError:
            check_call(init, args[1:], kwargs)
            raise
        init(*args, **kwargs)

    return checked


def check_call(init: Callable[..., None], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise the ``TypeError`` that explains why ``init(self, *args, **kwargs)`` fails."""
    signature = inspect.signature(init)
    options = [name for name in signature.parameters if name not in ("self", "model")]
    unknown = [name for name in kwargs if name not in signature.parameters]
    if unknown:
        hints = []
        for name in unknown:
            near = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
            hints.append(
                f"{name!r}" + (f" (did you mean {' or '.join(map(repr, near))}?)" if near else "")
            )
        raise TypeError(
            f"KFACPreconditioner got unknown option(s) {', '.join(hints)}; its options: "
            f"{', '.join(options)}"
        )
    if len(args) > 1:
        second = args[1]
        optimizers = isinstance(second, (list, tuple)) and bool(second)
        optimizers = optimizers and all(isinstance(o, torch.optim.Optimizer) for o in second)
        is_optimizer = isinstance(second, torch.optim.Optimizer) or optimizers
        what = "the optimizer" if is_optimizer else "every option"
        raise TypeError(
            "KFACPreconditioner takes the model positionally and every option by keyword: "
            f"pass {what} as "
            + ("optimizer=..." if what == "the optimizer" else "name=value")
            + f" (got {len(args)} positional arguments)"
        )
    if not args and "model" not in kwargs:
        raise TypeError("KFACPreconditioner needs the model: KFACPreconditioner(model, ...)")


def check_callback_options(init: Callable[..., None], kwargs: dict[str, Any]) -> None:
    """What a framework callback will hand ``init`` (the preconditioner's),
    checked when the callback is made: it builds the preconditioner only
    when training starts, after the model and the data have loaded, which
    is late to learn of a misspelt option.  Unknown names, a ``model`` (the
    callback passes the framework's) and the plain options' values are
    refused as the constructor would; what needs the model waits for it."""
    if "model" in kwargs:
        raise TypeError("the callback passes the training's model itself: leave model= out")
    check_call(init, (), {**kwargs, "model": None})
    options = {k: v for k, v in kwargs.items() if k in KFACConfig.field_names()}
    KFACConfig.from_options(
        **{k: v for k, v in options.items() if v is not None or k not in _ENGINE_OWNED}
    )


def check_runtime_arguments(
    model: Any,
    optimizer: Any,
    grad_scaler: Any,
    gradient_access: Any,
    pg_timeout_s: Any,
    loglevel: Any,
    topology: Any,
    engine: Any,
) -> None:
    """A ``TypeError``/``ValueError`` naming the first argument of a wrong type or value."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    as_optimizers(optimizer)
    if grad_scaler is not None and not (
        callable(getattr(grad_scaler, "get_scale", None)) or callable(grad_scaler)
    ):
        raise TypeError(
            "grad_scaler must be None, a torch.amp.GradScaler (anything with get_scale()) or a "
            f"callable returning the current loss scale; got {type(grad_scaler).__name__}"
        )
    if gradient_access is not None and not (
        callable(getattr(gradient_access, "read", None))
        and callable(getattr(gradient_access, "write", None))
    ):
        raise TypeError(
            "gradient_access must be None or an object with read(param) and write(param, value); "
            f"got {type(gradient_access).__name__}"
        )
    if pg_timeout_s is not None and (
        isinstance(pg_timeout_s, bool)
        or not isinstance(pg_timeout_s, (int, float))
        or not pg_timeout_s > 0
    ):
        raise ValueError(f"pg_timeout_s must be a positive number of seconds; got {pg_timeout_s!r}")
    if isinstance(loglevel, bool) or not isinstance(loglevel, int):
        raise TypeError(f"loglevel must be a logging level (an int); got {loglevel!r}")
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a kaisa.Topology or None; got {type(topology).__name__}")
    if engine is not None and not isinstance(engine, Engine):
        raise TypeError(
            f"engine must be a kaisa.engines.Engine or None; got {type(engine).__name__}"
        )


def check_method_options(method: CurvatureMethod, config: KFACConfig) -> None:
    """Refuse options a method cannot honour: a method whose :meth:`apply`
    updates its state every step (running moments,
    :class:`kaisa.methods.capabilities.StatefulApply`) must be handed the worker's
    own tensors, where ``precondition_dtype`` would hand it cast copies (the
    updates would land in a copy and the checkpoint would keep stale moments)."""
    if updates_state(method) and config.precondition_dtype is not None:
        what = f"compute_method={method.name!r}"
        if config.grafting is not None:
            what += f" and grafting={config.grafting.value!r}"
        raise ValueError(
            f"precondition_dtype={config.precondition_dtype} is not supported with "
            f"{what}: its apply() updates running moments in place, "
            "which a cast copy of them would not keep. Use precondition_dtype=None (the "
            "products then run in inv_dtype)"
        )


def _needs_every_worker(layers: list[KFACLayer]) -> str | None:
    """The first statistic formed from the method's state or reduced onto
    the workers, as ``layer.statistic`` (None: the plan may be any)."""
    for layer in layers:
        for stat in layer.statistics:
            if stat.needs_state:
                return f"{layer.name}.{stat.name}"
    return None


def check_method_plan(
    method: CurvatureMethod, layers: list[KFACLayer], plan: WorkPlan, fraction: object
) -> None:
    """Refuse a plan the method's statistics cannot run under: a statistic
    formed from the method's second-order state (EKFAC's eigenbases) is formed
    on every rank from its own examples, so every rank must hold that state —
    every rank a gradient worker of every layer (``grad_worker_fraction=1``,
    COMM-OPT).  Statistics from the weight gradient are not formed yet."""
    for layer in layers:
        for stat in layer.statistics:
            if stat.source is FactorSource.WEIGHT_GRAD:
                raise ValueError(
                    f"compute_method={method.name!r} declares statistic {stat.name!r} of layer "
                    f"{layer.name!r} from the weight gradient, which kaisa does not form yet; "
                    "allowed sources: input, output_grad, joint"
                )
    where = _needs_every_worker(layers)
    if where is None or plan.grad_workers == plan.world_size:
        return
    raise ValueError(
        f"grad_worker_fraction={fraction} is not supported with compute_method={method.name!r}: "
        f"its statistic {where} is formed on every rank from the layer's eigenbases, which "
        f"grad_worker_fraction={fraction} keeps on {plan.grad_workers} of "
        f"{plan.world_size} ranks. Use grad_worker_fraction=1 (COMM-OPT), or "
        "compute_method='eigen'"
    )


def _register(
    engine: Engine, model: nn.Module, config: KFACConfig, method: CurvatureMethod
) -> tuple[dict[str, KFACLayer], list[SkippedModule]]:
    """The layers this rank preconditions (the engine may keep or replace some,
    as tensor parallelism does), with the options every adapter takes."""
    adapters, skipped = register_layers(engine.unwrap(model), config.skip_layers)
    if isinstance(engine, ModelParallelLayers):  # it keeps or replaces some layers
        adapters = engine.select_layers(adapters, skipped, config)
    if not adapters:
        reasons = "; ".join(f"{s.name or '<root>'}: {s.reason}" for s in skipped)
        raise ValueError(
            f"model has no layer K-FAC can precondition (supported: {supported_layers()}; "
            "convolutions with groups=1; parameters not tied to another module). Skipped: "
            f"{reasons or 'nothing'}"
        )
    fraction, seed = config.factor_position_fraction, config.factor_position_seed or 0
    # one sampler for every layer: the pipeline sets its step (kaisa.core.positions)
    positions = None if fraction is None or fraction >= 1.0 else PositionSampler(fraction, seed)
    for adapter in adapters:
        adapter.positions = positions
        adapter.reduce = config.kfac_approx is KFACApprox.REDUCE
        adapter.factor_compute_dtype = config.factor_compute_dtype
        adapter.max_factor_dim = config.max_factor_dim
        adapter.large_factor = config.large_factor
    precondition = config.precondition_dtype
    layers = {}
    for a in adapters:
        statistics = method.statistics(a.effective_specs())
        dtypes = layer_dtypes(config, a.weight.dtype)
        layers[a.name] = KFACLayer(a, *dtypes, precondition, statistics=statistics)
    return layers, skipped


def _resolve_fraction(
    config: KFACConfig, layers: list[KFACLayer], world: int, method: CurvatureMethod | None
) -> Any:
    """``grad_worker_fraction`` as the plan takes it: ``'auto'`` chosen by the
    planner (COMM-OPT for a method whose statistics need every rank a worker);
    a fixed one as given, with a word where ``plan_costs`` or
    ``memory_budget_mb``, which only ``'auto'`` reads, were given too."""
    fraction = config.grad_worker_fraction
    if fraction is DistributedStrategy.AUTO:
        every = _needs_every_worker(layers) is not None
        return 1.0 if every else auto_fraction(layers, world, config, method)
    unused = [
        f"{name}={getattr(config, name)!r}"
        for name in ("plan_costs", "memory_budget_mb")
        if getattr(config, name) is not None
    ]
    if unused:
        verb, pronoun = ("are", "they are") if len(unused) > 1 else ("is", "it is")
        shown = getattr(fraction, "value", fraction)
        warn_user(
            f"kaisa: {' and '.join(unused)} {verb} read only to choose "
            f"grad_worker_fraction='auto'; with grad_worker_fraction={shown!r} {pronoun} not used",
        )
    return fraction


def build(
    model: nn.Module,
    setup: Setup,
    schedule: Schedule,
    pg_timeout_s: float | None,
    method: CurvatureMethod | None = None,
) -> Parts:
    config, engine, topology = setup.config, setup.engine, setup.topology
    given = method  # the planner resolves it as the run does (grafting applied once)
    method = resolve_method(given, config)
    check_method_options(method, config)
    layers, skipped = _register(engine, model, config, method)
    ordered = list(layers.values())
    changed = changes(ordered, skipped)
    if changed is not None:
        warn_user(changed)
    world = len(group_ranks(topology.dp if topology is not None else None))
    fraction = _resolve_fraction(config, ordered, world, given)
    plan = make_plan(
        [LayerSpec(la.name, la.factors) for la in ordered],
        world,
        fraction,
        config.assignment_strategy,
        config.colocate_factors,
    )
    check_method_plan(method, ordered, plan, _fraction_label(config.grad_worker_fraction))
    comm = Communicator(
        topology,
        plan.grad_workers,
        device_type=ordered[0].adapter.device.type,
        bucket_cap_mb=config.allreduce_bucket_cap_mb,
        symmetry_aware=config.symmetry_aware,
        timeout_s=pg_timeout_s,
    )
    capture = Capture(
        model,
        ordered,
        loss_average=config.loss_average,
        accumulation_steps=config.accumulation_steps,
        loss_divisor=setup.loss_divisor,
        in_hook=config.update_factors_in_hook,
        loss_scale=setup.scaling.getter(),
        method=method,
    )
    if isinstance(engine, ModelParallelLayers):  # it feeds some statistics itself
        engine.connect(comm, capture, ordered)
    reduction = FactorReduction(
        ordered,
        plan,
        comm,
        bucket_cap_mb=config.allreduce_bucket_cap_mb,
        symmetry_aware=config.symmetry_aware,
    )
    second_order = SecondOrderUpdate(plan, comm, method)
    application = GradientApplication(plan, comm, method, engine)
    pipeline = StepPipeline(
        layers=ordered,
        comm=comm,
        engine=engine,
        capture=capture,
        schedule=schedule,
        reduction=reduction,
        second_order=second_order,
        application=application,
        in_hook=config.update_factors_in_hook,
        scaling=setup.scaling,
    )
    checkpointer = Checkpointer(layers, plan, comm, method)
    pipeline.on_inverse_step = checkpointer.mirror.at_inverse_step
    logging.getLogger("kaisa").debug("%s", plan.describe())
    return Parts(engine, layers, skipped, plan, comm, method, capture, pipeline, checkpointer)


def _fraction_label(fraction: object) -> str:
    """``grad_worker_fraction`` as the user gave it (``0.5``, ``'mem-opt'``)."""
    value = getattr(fraction, "value", fraction)
    return repr(value) if isinstance(value, str) else f"{value:g}"
