"""The one place where kaisa reads and writes parameter gradients.

Engines that hide or shard ``.grad`` (DeepSpeed ZeRO, FSDP2) plug in here by
providing another :class:`GradientAccess`; the rest of kaisa only ever sees
the canonical ``[d_out, d_in(+1)]`` gradient matrix of a layer.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter

__all__ = ["GradientAccess", "ParamGradAccess", "read_grad_matrix", "write_grad_matrix"]


class GradientAccess(Protocol):
    """How to read and overwrite the (full, averaged) gradient of a parameter."""

    def read(self, param: nn.Parameter) -> Tensor | None: ...

    def write(self, param: nn.Parameter, value: Tensor) -> None: ...


class ParamGradAccess:
    """Plain ``param.grad``: single process, DDP, and manual all-reduce."""

    def read(self, param: nn.Parameter) -> Tensor | None:
        return param.grad

    def write(self, param: nn.Parameter, value: Tensor) -> None:
        grad = param.grad
        if grad is None:
            param.grad = value.detach().clone()
        else:
            grad.copy_(value)


def read_grad_matrix(adapter: LayerAdapter, access: GradientAccess) -> Tensor | None:
    """The layer's gradient matrix, or ``None`` if it got no gradient this step."""
    params = adapter.parameters()
    grads = [access.read(p) for p in params]
    if grads[0] is None:
        return None
    bias = None
    if adapter.has_bias:
        bias = grads[1] if grads[1] is not None else torch.zeros_like(params[1])
    return adapter.grads_to_matrix(grads[0], bias)


def write_grad_matrix(adapter: LayerAdapter, access: GradientAccess, matrix: Tensor) -> None:
    """Overwrite the layer's gradients with ``matrix`` (same layout as read)."""
    weight, bias = adapter.matrix_to_grads(matrix)
    params = adapter.parameters()
    access.write(params[0], weight)
    if bias is not None:
        access.write(params[1], bias)
