"""The accelerate recipe (``precond.step()`` when ``accelerator.sync_gradients``)
gives the parameters of the plain torch loop with kaisa, with accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")

from kaisa import KFACPreconditioner  # noqa: E402

KW = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2)
ACCUMULATE = 2
STEPS = 3


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(STEPS * ACCUMULATE)
    ]


def plain_loop() -> list[torch.Tensor]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(net, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    data = micro_batches()
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in data[step * ACCUMULATE : (step + 1) * ACCUMULATE]:
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
        precond.step()
        opt.step()
    return [p.detach() for p in net.parameters()]


def accelerate_loop() -> list[torch.Tensor]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    # the recipe: attach to the prepared model, tell it the accumulation
    precond = KFACPreconditioner(
        model, optimizer=opt.optimizer, accumulation_steps=ACCUMULATE, **KW
    )
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                precond.step()
            opt.step()
            opt.zero_grad()
    assert precond.steps == STEPS
    return [p.detach() for p in net.parameters()]


def test_accelerate_recipe_equals_plain_loop() -> None:
    for got, want in zip(accelerate_loop(), plain_loop()):
        assert float((got - want).norm() / want.norm()) <= 1e-10
