"""FSDP2 (fully_shard, gloo): a layer's full gradient is assembled only on its
gradient workers, each rank writes back only its rows, and with gradient
accumulation every fraction at W=2 and W=4 equals the unsharded single
process (float64, ≤ 1e-10).  Shards are uneven (torch.chunk), down to ranks
that hold no row of a layer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from harness import run_distributed

pytestmark = pytest.mark.distributed

B, ACCUMULATE, STEPS = 3, 2, 3
KW: dict[str, Any] = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3, bias=False)
    ).double()


def data(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    n = world * B
    return [
        (
            torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for _ in range(STEPS * ACCUMULATE)
    ]


def single(world: int) -> list[torch.Tensor]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(net, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    batches = data(world)
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
        precond.step()
        opt.step()
    return [p.detach() for p in net.parameters()]


def sharded(rank: int, world: int, fraction: float) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        net, optimizer=opt, accumulation_steps=ACCUMULATE, grad_worker_fraction=fraction, **KW
    )
    assert precond._parts.engine.name == "fsdp2"
    batches = data(world)
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(STEPS):
        opt.zero_grad()
        for i, (x, y) in enumerate(batches[step * ACCUMULATE : (step + 1) * ACCUMULATE]):
            net.set_requires_gradient_sync(i == ACCUMULATE - 1)
            (F.cross_entropy(net(x[mine]), y[mine]) / ACCUMULATE).backward()
        precond.step()
        opt.step()
    full = [p.full_tensor().detach() for p in net.parameters()]
    return {"params": full, "comm": precond.comm.stats.as_dict()}


@pytest.mark.parametrize("world,fraction", [(2, 1.0), (2, 0.5), (4, 1.0), (4, 0.5), (4, 0.25)])
def test_fsdp2_equals_unsharded_single_process(world: int, fraction: float) -> None:
    want = single(world)
    for res in run_distributed(world, sharded, fraction):
        for a, b in zip(res["params"], want):
            assert float((a - b).norm() / b.norm()) <= 1e-10


def double_step(rank: int, world: int) -> str:
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    fully_shard(net)
    precond = KFACPreconditioner(net, **KW)
    x, y = data(world)[0]
    F.cross_entropy(net(x), y).backward()
    precond.step()
    try:
        precond.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_fsdp2_double_step_is_refused() -> None:
    for message in run_distributed(2, double_step):
        assert "no backward pass since the last step()" in message
