"""A compiled DDP model with kaisa on 2 gloo ranks equals the eager one (issue 24).

``torch.compile`` of a DDP model splits its graph at DDP's buckets
(dynamo's DDPOptimizer), so kaisa's capture must hold across the pieces:
the statistics formed by the graphs, reduced over the ranks, give the same
factors and parameters as eager capture, on every rank, through factor and
inverse updates.

An ``nn.MultiheadAttention`` is tested with ``optimize_ddp=False`` (one
graph): with DDPOptimizer's split, torch 2.13 can cut the graph between an
autograd function's output tuple and the item taken from it, which AOTAutograd
then rejects ("output spec mismatch"; found with kaisa's attention, whose
module's own dead computation moves the bucket boundary there).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

from kaisa import KFACPreconditioner

from harness import run_distributed

pytestmark = pytest.mark.distributed


class Net(nn.Module):
    """Two 512-wide hidden layers (2 MB of parameters: two DDP buckets of
    1 MB, so two graphs), or an attention of width 64 (one bucket)."""

    def __init__(self, attention: bool) -> None:
        super().__init__()
        width = 64 if attention else 512
        self.inp = nn.Linear(6, width)
        self.attn = (
            nn.MultiheadAttention(width, 2, batch_first=True)
            if attention
            else nn.Linear(width, width)
        )
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if isinstance(self.attn, nn.MultiheadAttention):
            a, _ = self.attn(h, h, h, need_weights=False)
        else:
            a = self.attn(h)
        return self.head(torch.tanh(self.mid(a + h)).mean(1))


def train(rank: int, world: int, compiled: bool, attention: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = not attention  # see the module docstring
    torch.manual_seed(0)
    net = Net(attention)
    # buckets of 1 MB (DDPOptimizer's least): the compiled graph is split in pieces
    model = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1)
    precond = KFACPreconditioner(
        model, factor_update_steps=2, inv_update_steps=4, damping=0.1, lr=0.1
    )
    graphs: list[int] = []

    def counting(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
        graphs.append(1)
        return lookup_backend("aot_eager")(gm, example)

    forward = torch.compile(model, backend=counting) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(10 * rank + step)
        x = torch.randn(4, 5, 6, generator=g)
        opt.zero_grad()
        F.cross_entropy(forward(x), torch.randint(0, 4, (4,), generator=g)).backward()
        precond.step()
        opt.step()
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "factors": {
            name: [t.clone() for t in layer.running if t is not None]
            for name, layer in precond.layers.items()
        },
        "captured": all(layer.captured for layer in precond.layers.values()),
        "graphs": len(graphs),
    }


@pytest.mark.parametrize("attention", [False, True], ids=["split-graph", "attention"])
def test_compiled_ddp_equals_eager_ddp(attention: bool) -> None:
    eager = run_distributed(2, train, False, attention)
    compiled = run_distributed(2, train, True, attention)
    for rank, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        assert got["captured"] and want["captured"], rank
        # in two variants (factor step or not): one graph each, or pieces at DDP's buckets
        assert got["graphs"] == 2 if attention else got["graphs"] > 2, got["graphs"]
        assert set(got["factors"]) == set(want["factors"])
        assert any(name.endswith(".q") for name in got["factors"]) == attention
        for name, factors in got["factors"].items():
            for a, b in zip(factors, want["factors"][name], strict=True):
                assert float((a - b).norm() / b.norm()) <= 1e-5, (rank, name)
        for a, b in zip(got["params"], want["params"], strict=True):
            assert float((a - b).norm() / b.norm()) <= 1e-5, rank
    for a, b in zip(compiled[0]["params"], compiled[1]["params"], strict=True):
        torch.testing.assert_close(a, b)  # the ranks agree
