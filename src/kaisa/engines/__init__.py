"""Training engines: where gradients live and how the model is wrapped.

:func:`select_engine` is the one place an engine is chosen.
"""

from __future__ import annotations

from torch import nn

from kaisa.engines.base import Engine, GradientMarks
from kaisa.engines.pytorch import GradientAccess, ParamGradAccess, TorchEngine, unwrap_model
from kaisa.scaling import LossScaling

__all__ = [
    "Engine",
    "GradientAccess",
    "GradientMarks",
    "ParamGradAccess",
    "TorchEngine",
    "select_engine",
    "unwrap_model",
]


def select_engine(
    model: nn.Module,
    gradient_access: GradientAccess | None = None,
    scaling: LossScaling | None = None,
) -> Engine:
    """The engine for ``model``: today plain PyTorch (``.grad``, DDP, DataParallel,
    ``torch.compile``); DeepSpeed and FSDP2 plug in here."""
    return TorchEngine(gradient_access, scaling)
