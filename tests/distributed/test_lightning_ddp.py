"""Lightning under DDP on 2 gloo ranks equals the plain DDP loop with kaisa."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from kaisa.integrations.lightning import KFACCallback  # noqa: E402

from framework_case import (  # noqa: E402
    ACCUMULATE,
    KW,
    STEPS,
    assert_close,
    ddp_loop,
    micro_batches,
)
from harness import run_distributed  # noqa: E402
from lightning_case import Module  # noqa: E402

pytestmark = pytest.mark.distributed


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
        shard = micro_batches(2 * STEPS * ACCUMULATE)[rank::2]
        loader = torch.utils.data.DataLoader(shard, batch_size=None, shuffle=False)
        trainer.fit(module, loader)
    return [p.detach().clone() for p in module.net.parameters()]


def both(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return lightning_run(rank), ddp_loop(rank, world)


def test_lightning_ddp_with_accumulation_equals_plain_ddp_loop() -> None:
    for got, want in run_distributed(2, both, timeout_s=120):
        assert_close(got, want)
