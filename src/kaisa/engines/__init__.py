"""Training engines: where gradients live and how the model is wrapped.

:func:`select_engine` is the one place an engine is chosen.  Every engine
implements :class:`Engine`; what only some do is one of the capability
protocols (:class:`InPlaceGradients`, :class:`ShardedReads`,
:class:`ModelParallelLayers`, :class:`OwnsTheLoop`).
"""

from __future__ import annotations

from torch import nn

from kaisa.engines.base import (
    Engine,
    EngineDefaults,
    GradientMarks,
    InPlaceGradients,
    ModelParallelLayers,
    OwnsTheLoop,
    ReplayableGradients,
    ShardedReads,
)
from kaisa.engines.pytorch import GradientAccess, ParamGradAccess, TorchEngine, unwrap_model

__all__ = [
    "Engine",
    "EngineDefaults",
    "GradientAccess",
    "GradientMarks",
    "InPlaceGradients",
    "ModelParallelLayers",
    "OwnsTheLoop",
    "ParamGradAccess",
    "ReplayableGradients",
    "ShardedReads",
    "TorchEngine",
    "select_engine",
    "unwrap_model",
]


def select_engine(model: nn.Module, gradient_access: GradientAccess | None = None) -> Engine:
    """The engine for ``model``: a ``deepspeed.DeepSpeedEngine`` gets
    :class:`~kaisa.engines.deepspeed.DeepSpeedEngine`; anything else plain
    PyTorch (``.grad``, DDP, DataParallel, ``torch.compile``); a model sharded
    with ``fully_shard`` gets :class:`~kaisa.engines.fsdp.FSDP2Engine`; one
    whose weights are DTensors sharded by ``parallelize_module``, or that
    holds Megatron-core parallel linears split over a tensor-parallel group,
    gets :class:`~kaisa.engines.tensor_parallel.engine.TensorParallelEngine`."""
    from kaisa.engines.deepspeed import DeepSpeedEngine, is_deepspeed_engine
    from kaisa.engines.fsdp import FSDP2Engine, is_fsdp2_model
    from kaisa.engines.tensor_parallel.engine import TensorParallelEngine
    from kaisa.engines.tensor_parallel.shards import tensor_parallel_group

    if is_deepspeed_engine(model):
        if gradient_access is not None:
            raise ValueError(
                "gradient_access cannot be combined with a DeepSpeed engine, which reads "
                "its own (partitioned) gradients"
            )
        return DeepSpeedEngine(model)
    if is_fsdp2_model(model) and gradient_access is None:
        return FSDP2Engine()  # fully_shard's Shard(0) DTensors (FSDP + TP: not yet)
    tp = None if is_fsdp2_model(model) else tensor_parallel_group(model)
    if tp is not None:
        if gradient_access is not None:
            raise ValueError(
                "gradient_access cannot be combined with tensor parallelism (parallelize_module, "
                "Megatron), whose gradients kaisa reads through their local shards"
            )
        return TensorParallelEngine(tp)
    return TorchEngine(gradient_access)
