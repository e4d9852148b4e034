"""Tensor parallelism's exact mode: the forward hooks that gather a call's
shards onto a layer's primary rank before :meth:`kaisa.step.capture.calls.Capture.observe`.

A rowwise layer's input is sharded on its last dimension (its output
gradient replicated): the input shards are gathered in the forward hook.  A
colwise layer's output gradient is sharded (its input replicated): the
gradient shards are gathered in the output's tensor hook.  Ranks that are
not the primary send their shard and keep nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from kaisa.engines.tensor_parallel.group import TPGroup
from kaisa.layers.state import KFACLayer
from kaisa.layers.tensor_parallel import ExactShardedAdapter, Style, local
from kaisa.step.capture.calls import Capture
from kaisa.step.capture.hooks import ModuleHook, first_tensor

__all__ = ["ExactCapture"]


class ExactCapture:
    """Forward hooks on every exact-mode layer, on every tensor-parallel rank.

    Each decides with :meth:`Capture.accepts` (the same answer on every rank)
    whether the call is captured; if so it gathers the shards the primary
    needs — the input of a rowwise layer now, the output gradient of a
    colwise layer when it arrives — and, on the primary, hands the full
    tensors to :meth:`Capture.observe`.
    """

    def __init__(self, capture: Capture, group: TPGroup, layers: dict[str, KFACLayer]) -> None:
        self.capture = capture
        self.group = group
        self.layers = layers

    def install(self, adapters: list[ExactShardedAdapter]) -> list[Any]:
        return [
            a.module.register_forward_hook(ModuleHook(self._hook(a), a.module)) for a in adapters
        ]

    def _hook(self, adapter: ExactShardedAdapter) -> Callable[[nn.Module, Any, Any], None]:
        group, capture = self.group, self.capture
        layer = self.layers.get(adapter.name)  # None where this rank is not the primary

        def gather(full: int) -> Callable[[Tensor], Tensor | None]:
            return lambda t: group.gather_last_dim(local(t).detach(), adapter.primary, full)

        def hook(module: nn.Module, inputs: Any, result: Any) -> None:
            x = first_tensor(inputs)
            output = adapter.output_tensor(result)  # Megatron: the first of (output, bias)
            if x is None or output is None:
                return
            if not capture.accepts(adapter, module, output):
                return
            if adapter.style is Style.ROWWISE:
                full_x = gather(adapter.in_features)(x)
                if layer is not None and full_x is not None:
                    capture.observe(layer, module, full_x, output, grad_view=local)
                return
            view = gather(adapter.out_features)
            if layer is not None:
                capture.observe(layer, module, local(x), output, grad_view=view)  # type: ignore[arg-type]
            else:
                output.register_hook(lambda g: _discard(view(g)))

        return hook


def _discard(_: Any) -> None:
    return None
