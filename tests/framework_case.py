"""The one training problem every framework integration is compared on.

A small float64 MLP, SGD with momentum, ``STEPS`` optimizer steps of
``ACCUMULATE`` micro-batches each; :func:`plain_loop` is the reference: the
plain torch loop with kaisa that every integration must reproduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kfac_defaults import kfac_pytorch

# written for kfac-pytorch's values: factors every step, the eigen method
KW = kfac_pytorch(damping=0.01, kl_clip=0.05, inv_update_steps=2)
ACCUMULATE = 2
STEPS = 3


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def micro_batches(count: int = STEPS * ACCUMULATE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(count)
    ]


def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def plain_loop() -> list[torch.Tensor]:
    net = make_net()
    opt = make_optimizer(net)
    precond = KFACPreconditioner(net, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    data = micro_batches()
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in data[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
        precond.step()
        opt.step()
    return [p.detach() for p in net.parameters()]


def ddp_loop(rank: int, world: int) -> list[torch.Tensor]:
    """The plain DDP loop with kaisa; rank ``r`` takes micro-batches ``r::world``
    of ``world · STEPS · ACCUMULATE`` (its own shard, as every framework test)."""
    from torch.nn.parallel import DistributedDataParallel

    net = make_net()
    ddp = DistributedDataParallel(net)
    opt = make_optimizer(net)
    precond = KFACPreconditioner(ddp, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    mine = micro_batches(world * STEPS * ACCUMULATE)[rank::world]
    for step in range(STEPS):
        opt.zero_grad()
        chunk = mine[step * ACCUMULATE : (step + 1) * ACCUMULATE]
        for i, (x, y) in enumerate(chunk):
            if i < len(chunk) - 1:
                with ddp.no_sync():
                    (F.cross_entropy(ddp(x), y) / ACCUMULATE).backward()
            else:
                (F.cross_entropy(ddp(x), y) / ACCUMULATE).backward()
        precond.step()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def accelerate_recipe(
    accelerate: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The documented accelerate recipe over this rank's ``batches``."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    net = make_net()
    model, opt = accelerator.prepare(net, make_optimizer(net))
    # the recipe: attach to the prepared model, tell it the accumulation
    precond = KFACPreconditioner(
        model, optimizer=opt.optimizer, accumulation_steps=ACCUMULATE, **KW
    )
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                precond.step()
            opt.step()
            opt.zero_grad()
    assert precond.steps == STEPS
    return [p.detach().clone() for p in net.parameters()]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-10) -> None:
    for a, b in zip(got, want):
        err = float((a.detach() - b).norm() / b.norm())
        assert err <= tol, f"relative error {err:.2e}"


#: what a framework callback must refuse when it is made (keywords, error, message)
BAD_CALLBACK_OPTIONS = [
    ({"dampng": 0.01}, TypeError, "did you mean 'damping'"),
    ({"damping": -1.0}, ValueError, "damping must be in"),
    ({"compute_method": "eigne"}, ValueError, "compute_method must be one of"),
    ({"model": nn.Linear(2, 2)}, TypeError, "leave model= out"),
]


def check_refused_when_made(callback: Any, options: dict, error: type, match: str) -> None:
    """The preconditioner is built when training starts, after the model and
    the data have loaded: a misspelt option or a bad value is refused at once
    by the callback's constructor, and None is the framework's value."""
    import pytest

    with pytest.raises(error, match=match):
        callback(**options)
    callback(damping=0.01, lr=None, accumulation_steps=None)
