"""The accelerate recipe (``precond.step()`` when ``accelerator.sync_gradients``)
gives the parameters of the plain torch loop with kaisa, with accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")

from kaisa import KFACPreconditioner  # noqa: E402

from framework_case import (  # noqa: E402
    ACCUMULATE,
    KW,
    STEPS,
    assert_close,
    make_net,
    make_optimizer,
    micro_batches,
    plain_loop,
)


def accelerate_loop() -> list[torch.Tensor]:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    net = make_net()
    opt = make_optimizer(net)
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
    assert_close(accelerate_loop(), plain_loop())
