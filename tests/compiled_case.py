"""What the compiled-capture tests share: a graph-counting backend, the
loss they train on, and the comparison of two preconditioners' statistics
and parameters (tests/unit/step/test_compiled_capture.py, test_compiled_attention.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._dynamo.backends.registry import lookup_backend

from kaisa import KFACPreconditioner

__all__ = ["Counting", "assert_close", "loss_of"]


class Counting:
    """A dynamo backend that counts the graphs it compiles and each run of one."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.inner = inner
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
        self.compiled += 1
        fn = lookup_backend(self.inner)(gm, example)

        def run(*args: Any) -> Any:
            self.runs += 1
            return fn(*args)

        return run


def loss_of(out: Tensor) -> Tensor:
    """A mean-reduced loss over the data points (and positions)."""
    return out.logsumexp(-1).mean() - out[..., 0].mean()


def assert_close(a: KFACPreconditioner, b: KFACPreconditioner, tol: float = 1e-5) -> None:
    for name, la in a.layers.items():
        lb = b.layers[name]
        assert la.captured and lb.captured, name
        for i, (x, y) in enumerate(zip(la.running, lb.running, strict=True)):
            assert x is not None and y is not None
            err = float((x - y).norm() / y.norm())
            assert err <= tol, f"{name} factor {i}: {err:.2e}"
    pa = [p for la in a.layers.values() for p in la.adapter.parameters()]
    pb = [p for lb in b.layers.values() for p in lb.adapter.parameters()]
    for x, y in zip(pa, pb, strict=True):
        assert float((x - y).detach().norm() / y.detach().norm()) <= tol
