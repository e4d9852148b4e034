"""Rows per layer, measured: one forward/backward of an example batch.

The planner sizes factor products by the rows each layer's input factor
counts; a convolution's rows depend on its input's spatial size, a
sequence model's on the sequence length.  :func:`probe_rows` measures them
with a real preconditioner, so it lives apart from the pure forecast (which
the preconditioner itself reads when it chooses ``grad_worker_fraction``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from kaisa.core.specs import FactorSource
from kaisa.preconditioner import KFACPreconditioner

__all__ = ["ROW_OPTIONS", "probe_rows"]


#: the options that change how many rows a factor step's Grams read
ROW_OPTIONS = ("kfac_approx", "factor_position_fraction", "factor_position_seed", "skip_layers")


def probe_rows(
    model: nn.Module, example: Sequence[Any], scale: float = 1.0, **kfac: Any
) -> dict[str, int]:
    """Rows each layer's input factor counts in one forward/backward of
    ``model(*example)`` (times ``scale``, e.g. batch size / example batch).
    ``kfac``: the run's options; those of :data:`ROW_OPTIONS` are applied (a
    fraction of the positions reads that fraction of the rows), the others
    ignored."""
    options = {k: v for k, v in kfac.items() if k in ROW_OPTIONS}
    precond = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=1, kl_clip=None, **options
    )
    try:
        out = model(*example)
        first = out if isinstance(out, torch.Tensor) else next(iter(_tensors(out)))
        first.float().sum().backward()
        rows = {}
        for name, layer in precond.layers.items():
            i = next((k for k, s in enumerate(layer.factors) if s.source is FactorSource.INPUT), 0)
            rows[name] = round(layer.batch.counts[i] * scale)
    finally:
        precond.remove_hooks()
        model.zero_grad(set_to_none=True)
    return rows


def _tensors(out: Any) -> list[torch.Tensor]:
    values = out.values() if isinstance(out, Mapping) else out
    found = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not found:
        raise ValueError("the model's output holds no floating-point tensor to backpropagate")
    return found
