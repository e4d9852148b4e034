"""Lightning under DDP on 2 gloo ranks equals the plain DDP loop with kaisa."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from kaisa import KFACPreconditioner  # noqa: E402
from kaisa.integrations.lightning import KFACCallback  # noqa: E402

from harness import run_distributed  # noqa: E402

pytestmark = pytest.mark.distributed

KW = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2)
ACCUMULATE = 2
STEPS = 3


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(2 * STEPS * ACCUMULATE)
    ]


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def lightning_run(rank: int) -> list[torch.Tensor]:
    # The process group exists already: Lightning joins it instead of launching
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = Module()
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            precision="64-true",
            accumulate_grad_batches=ACCUMULATE,
            callbacks=[KFACCallback(**KW)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            use_distributed_sampler=False,  # each rank loads its own shard, as below
        )
        shard = micro_batches()[rank::2]
        loader = torch.utils.data.DataLoader(shard, batch_size=None, shuffle=False)
        trainer.fit(module, loader)
    return [p.detach().clone() for p in module.net.parameters()]


def plain_run(rank: int, world: int) -> list[torch.Tensor]:
    net = make_net()
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(ddp, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    mine = micro_batches()[rank::world]
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


def both(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return lightning_run(rank), plain_run(rank, world)


def test_lightning_ddp_with_accumulation_equals_plain_ddp_loop() -> None:
    for rank, (got, want) in enumerate(run_distributed(2, both, timeout_s=120)):
        for a, b in zip(got, want):
            assert float((a - b).norm() / b.norm()) <= 1e-10, f"rank {rank}"
