"""Lightning's KFACCallback gives the parameters of the plain torch loop with kaisa."""

from __future__ import annotations

import logging

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from kaisa.integrations.lightning import KFACCallback  # noqa: E402

from framework_case import (  # noqa: E402
    ACCUMULATE,
    KW,
    STEPS,
    assert_close,
    micro_batches,
    plain_loop,
)
from lightning_case import Module  # noqa: E402


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
    assert_close(list(module.net.parameters()), plain_loop())
    # the callback's state is the preconditioner's (saved in Lightning checkpoints)
    assert callback.state_dict()["steps"] == STEPS
