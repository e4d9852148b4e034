"""The plain-PyTorch engine: ``param.grad`` in one process, DDP, DataParallel,
or gradients averaged by hand; models wrapped by DDP, DataParallel or
``torch.compile``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from kaisa.core.workspace import Workspace
from kaisa.engines.base import (
    Engine,
    GradientMarks,
    InPlaceGradients,
    ReplayableGradients,
    unique_parameters,
)
from kaisa.layers.base import LayerAdapter, sole_owners

__all__ = ["GradientAccess", "ParamGradAccess", "TorchEngine", "unwrap_model"]

_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP, DataParallel and ``torch.compile`` wrappers, in any nesting."""
    while True:
        if isinstance(model, _WRAPPERS):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            return model


class GradientAccess(Protocol):
    """How to read and overwrite the (full, averaged) gradient of a parameter."""

    def read(self, param: nn.Parameter) -> Tensor | None: ...

    def write(self, param: nn.Parameter, value: Tensor) -> None: ...


class ParamGradAccess:
    """Plain ``param.grad``."""

    def read(self, param: nn.Parameter) -> Tensor | None:
        grad = param.grad
        if grad is not None and hasattr(grad, "placements"):
            raise RuntimeError(
                "kaisa: this parameter's gradient is a DTensor, but the model was not sharded "
                "when KFACPreconditioner was built: construct the preconditioner after "
                "parallelize_module / fully_shard"
            )
        return grad

    def write(self, param: nn.Parameter, value: Tensor) -> None:
        grad = param.grad
        if grad is None:
            param.grad = value.detach().clone()
        else:
            grad.copy_(value)


class TorchEngine(Engine, InPlaceGradients, ReplayableGradients):
    """Gradients in ``param.grad`` (or behind a user-supplied :class:`GradientAccess`).

    Plain tensors, so it offers the in-place fast path
    (:class:`~kaisa.engines.base.InPlaceGradients`) — for the layers that
    own their parameters, where the gradients are ``param.grad`` itself."""

    name = "torch"

    def __init__(self, access: GradientAccess | None = None) -> None:
        self.access: GradientAccess = access or ParamGradAccess()
        self._ddp = False

    def unwrap(self, model: nn.Module) -> nn.Module:
        outer: nn.Module | None = model
        while outer is not None:
            if isinstance(outer, nn.parallel.DistributedDataParallel):
                self._ddp = True
                break
            outer = getattr(outer, "_orig_mod", None)
        return unwrap_model(model)

    def gradients_agree(self) -> bool:
        # DDP averages every parameter's gradient on every rank (unused ones too,
        # with find_unused_parameters), so presence is the same everywhere
        return self._ddp and isinstance(self.access, ParamGradAccess)

    def replayable(self) -> bool:
        # a user-supplied GradientAccess may move or compute gradients in Python
        return isinstance(self.access, ParamGradAccess)

    def present(self, adapter: LayerAdapter) -> bool:
        return self.access.read(adapter.weight) is not None

    def local_gradients(self, adapters: Sequence[LayerAdapter]) -> list[Tensor]:
        grads = (self.access.read(p) for p in unique_parameters(adapters))
        return [g for g in grads if g is not None]

    def read(self, adapter: LayerAdapter) -> Tensor | None:
        return adapter.matrix_of([self.access.read(p) for p in adapter.parameters()])

    def write(self, adapter: LayerAdapter, matrix: Tensor) -> None:
        weight, bias = adapter.matrix_to_grads(matrix)
        values = [weight] if bias is None else [weight, bias]
        for param, rows, value in zip(adapter.parameters(), adapter.param_rows(), values):
            if not param.requires_grad:  # frozen since the preconditioner was built
                continue
            if rows is None:
                self.access.write(param, value)
                continue
            current = self.access.read(param)
            if isinstance(self.access, ParamGradAccess) and current is not None:
                current[rows].copy_(value)  # the other rows belong to other layers
                continue
            full = torch.zeros_like(param) if current is None else current.clone()
            full[rows] = value
            self.access.write(param, full)

    def write_many(self, adapters: Sequence[LayerAdapter], matrices: Sequence[Tensor]) -> None:
        targets: list[Tensor] = []
        values: list[Tensor] = []
        for adapter, matrix in zip(adapters, matrices, strict=True):
            weight, bias = adapter.matrix_to_grads(matrix)
            for param, value in zip(adapter.parameters(), (weight, bias)):
                if value is None or not param.requires_grad:  # frozen since built
                    continue
                if param.grad is None:
                    param.grad = value.detach().clone()
                else:
                    targets.append(param.grad)
                    values.append(value)
        if targets:
            torch._foreach_copy_(targets, values)

    def rescalable(self, adapters: Sequence[LayerAdapter]) -> list[bool]:
        if not isinstance(self.access, ParamGradAccess):
            return [False] * len(adapters)
        return sole_owners(adapters)

    def rescale(self, adapters: Sequence[LayerAdapter], nu: Tensor | float) -> None:
        grads = [p.grad for a in adapters for p in a.parameters()]
        torch._foreach_mul_([g for g in grads if g is not None], nu)

    def read_into(self, adapter: LayerAdapter, work: Workspace | None) -> Tensor | None:
        grads = [self.access.read(p) for p in adapter.parameters()]
        if work is None or grads[0] is None:
            return adapter.matrix_of(grads)
        return adapter.matrix_of(grads, work.take("gradient", adapter.matrix_shape, grads[0].dtype))

    def grad_blocks(self, adapter: LayerAdapter) -> list[Tensor] | None:
        if not isinstance(self.access, ParamGradAccess):
            return None
        return adapter.grad_blocks([p.grad for p in adapter.parameters()])

    def gradient_marks(self, adapters: Sequence[LayerAdapter]) -> Iterable[Any]:
        of = GradientMarks.of
        if type(self.access) is ParamGradAccess:  # read straight: twice a step
            return (of(a.weight.grad) for a in adapters)
        read = self.access.read
        return (of(read(a.weight)) for a in adapters)
