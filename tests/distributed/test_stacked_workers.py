"""Layers of one shape stacked where each layer has its own workers (f < 1).

Under HYBRID-OPT and MEM-OPT a rank preconditions only the layers it is a
gradient worker of; those of one shape are stacked (kaisa.step.batched) and
each ``V`` is broadcast to its receivers as before.  The run equals the
single process (float64, ≤ 1e-10), ranks really stack, and each rank's
``memory_usage()['stacked']`` is what the planner forecast for it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.planner.forecast import forecast, layer_costs

from harness import run_distributed

pytestmark = pytest.mark.distributed

B, STEPS = 3, 4
KW: dict[str, Any] = dict(factor_update_steps=1, inv_update_steps=2, damping=0.05, kl_clip=0.01)


def tower() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 3)).double()


def batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(world * B, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (world * B,), generator=g),
        )
        for _ in range(STEPS)
    ]


def train(rank: int, world: int, fraction: float | None) -> dict[str, Any]:
    model = tower()
    kw = dict(KW) if fraction is None else dict(KW, grad_worker_fraction=fraction)
    precond = KFACPreconditioner(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = slice(rank * B, (rank + 1) * B) if fraction is not None else slice(None)
    for x, y in batches(world):
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        if fraction is not None:  # hand-averaged gradients, as DDP would
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        opt.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "memory": precond.memory_usage(),
    }


@pytest.mark.parametrize("world,fraction", [(2, 0.5), (4, 0.5), (4, 0.25)])
def test_stacked_workers_equal_the_single_process(world: int, fraction: float) -> None:
    want = train(0, world, None)
    runs = run_distributed(world, train, fraction)
    predicted = forecast(
        layer_costs(tower(), **KW),
        world,
        gradients_agree=False,
        grad_worker_fraction=fraction,
        **KW,
    )
    for rank, got in enumerate(runs):
        for a, b in zip(got["params"], want["params"], strict=True):
            assert float((a - b).norm() / b.norm()) <= 1e-10, rank
        assert got["memory"]["stacked"] == int(predicted.memory["stacked"][rank]), rank
        assert got["memory"]["total"] == int(predicted.memory["total"][rank]), rank
    assert any(got["memory"]["stacked"] > 0 for got in runs)  # the ranks did stack
