"""Lightning's KFACCallback gives the parameters of the plain torch loop with kaisa."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from kaisa import KFACPreconditioner  # noqa: E402
from kaisa.integrations.lightning import KFACCallback  # noqa: E402

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


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


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


def test_callback_equals_plain_loop_with_accumulation(tmp_path) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = Module()
    callback = KFACCallback(**KW)
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        precision="64-true",
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    assert callback.preconditioner is not None
    assert callback.preconditioner.steps == STEPS
    assert callback.preconditioner.config.accumulation_steps == ACCUMULATE
    for got, want in zip(module.net.parameters(), plain_loop()):
        assert float((got.detach() - want).norm() / want.norm()) <= 1e-10
    # the callback's state is the preconditioner's (saved in Lightning checkpoints)
    assert callback.state_dict()["steps"] == STEPS
