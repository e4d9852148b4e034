"""Hooks that capture layer inputs and output gradients.

* A forward hook on each registered module sees its input and registers a
  *tensor* hook on its output, which fires with the gradient w.r.t. that
  output.  Unlike ``register_full_backward_hook`` this works on the first
  layer and when an in-place activation follows the layer.
* A forward pre-hook on the root model numbers the forward passes, so that
  gradient accumulation over micro-batches (and modules called several times
  per pass) are normalised correctly.

Capture is dtype-agnostic: the rows are cast to the factor dtype and the
Gram matrices are computed with autocast disabled, whatever precision the
forward pass ran in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kaisa.config import LossAverage
from kaisa.factors import grad_multiplier
from kaisa.layer import KFACLayer

__all__ = ["Capture"]

ScaleGetter = Callable[[], Tensor | float | None]


def _first_tensor(inputs: Any) -> Tensor | None:
    if isinstance(inputs, Tensor):
        return inputs
    if isinstance(inputs, (tuple, list)) and inputs and isinstance(inputs[0], Tensor):
        return inputs[0]
    return None


def _add_input(layer: KFACLayer, x: Tensor) -> None:
    """A's contribution of one call, in the factor dtype, never under autocast."""
    with torch.autocast(x.device.type, enabled=False):
        layer.stats.add_a(layer.adapter.a_rows(x), layer.factor_dtype)


def _add_grad(
    layer: KFACLayer, g: Tensor, batch: int, multiplier: float | Tensor, pass_id: int
) -> None:
    """G's contribution of one call (both the hook and the deferred path use it)."""
    with torch.autocast(g.device.type, enabled=False):
        rows = layer.adapter.grad_output_rows(g)
        layer.stats.add_g(rows, batch, multiplier, pass_id, layer.factor_dtype)


class Capture:
    """Owns every hook kaisa registers; :meth:`remove` takes them all off.

    Args:
        model: the root module (forward passes are counted on it).
        layers: the registered layers.
        loss_average: what the loss was averaged over (sets ``ĝ = m·g``).
        accumulation_steps: micro-batches per optimizer step.
        in_hook: compute Gram matrices inside the hooks (no activations kept)
            or keep the raw tensors until :meth:`flush`.
        loss_scale: returns the current loss scale of a grad scaler (or None).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[KFACLayer],
        *,
        loss_average: LossAverage,
        accumulation_steps: int,
        in_hook: bool,
        loss_scale: ScaleGetter | None = None,
    ) -> None:
        self.loss_average = loss_average
        self.accumulation_steps = accumulation_steps
        self.in_hook = in_hook
        self.loss_scale = loss_scale
        self.enabled = True
        self.pass_id = 0
        self.on_grad_captured: Callable[[KFACLayer], None] | None = None
        self._handles: list[RemovableHandle] = [model.register_forward_pre_hook(self._count_pass)]
        for layer in layers:
            self._handles.append(
                layer.adapter.module.register_forward_hook(self._forward_hook(layer))
            )

    # -- hooks -------------------------------------------------------------
    def _count_pass(self, module: nn.Module, inputs: Any) -> None:
        if self.enabled and module.training and torch.is_grad_enabled():
            self.pass_id += 1

    def _forward_hook(self, layer: KFACLayer) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            if not (self.enabled and module.training and torch.is_grad_enabled()):
                return
            x = _first_tensor(inputs)
            if x is None or not isinstance(output, Tensor) or not output.requires_grad:
                return
            batch = layer.adapter.batch_size(x)
            pass_id = self.pass_id
            x = x.detach()
            if self.in_hook:
                _add_input(layer, x)
            else:
                layer.pending.inputs.append(x)
            output.register_hook(self._grad_hook(layer, batch, pass_id))

        return hook

    def _grad_hook(self, layer: KFACLayer, batch: int, pass_id: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            g = grad.detach()
            multiplier: float | Tensor = self._multiplier(layer, g, batch)
            if self.in_hook:
                _add_grad(layer, g, batch, multiplier, pass_id)
            else:
                layer.pending.grads.append((g, batch, multiplier, pass_id))
            if self.on_grad_captured is not None:
                self.on_grad_captured(layer)

        return hook

    def _multiplier(self, layer: KFACLayer, g: Tensor, batch: int) -> float | Tensor:
        rows = g.numel() // layer.adapter.g_dim  # no reshape (a copy for conv) just to count
        m: float | Tensor = grad_multiplier(
            self.loss_average, batch, max(rows // max(batch, 1), 1), self.accumulation_steps
        )
        if self.loss_scale is not None:
            scale = self.loss_scale()
            if scale is not None:
                m = m / scale
        return m

    # -- deferred path -------------------------------------------------------
    def flush(self, layer: KFACLayer) -> None:
        """Turn raw captures kept by ``in_hook=False`` into statistics."""
        pending = layer.pending
        for x in pending.inputs:
            _add_input(layer, x)
        for g, batch, multiplier, pass_id in pending.grads:
            _add_grad(layer, g, batch, multiplier, pass_id)
        pending.inputs.clear()
        pending.grads.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def active(self) -> bool:
        return bool(self._handles)
