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


def make_trainer(tmp_path, callback: KFACCallback, **limits) -> pl.Trainer:
    """A float64 CPU Trainer with the callback, accumulating ACCUMULATE micro-batches."""
    return pl.Trainer(
        **limits,
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


def test_callback_equals_plain_loop_with_accumulation(tmp_path) -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = Module()
    callback = KFACCallback(**KW)
    trainer = make_trainer(tmp_path, callback, max_steps=STEPS)
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    trainer.fit(module, loader)
    assert callback.preconditioner is not None
    assert callback.preconditioner.steps == STEPS
    assert callback.preconditioner.config.accumulation_steps == ACCUMULATE
    assert_close(list(module.net.parameters()), plain_loop())
    # the callback's state is the preconditioner's (saved in Lightning checkpoints)
    assert callback.state_dict()["steps"] == STEPS


def fit(tmp_path, epochs: int, callback: KFACCallback, ckpt_path=None) -> Module:
    """Epochs of 3 optimizer steps (inverse updates at steps 0, 2, 4, …)."""
    module = Module()
    trainer = make_trainer(tmp_path, callback, max_epochs=epochs)
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(tmp_path / f"epoch{epochs}.ckpt")
    return module


@pytest.mark.parametrize("second_order", [True, False])
def test_resume_between_inverse_updates(tmp_path, second_order: bool) -> None:
    """Resumed after epoch 1 (3 steps: step 3 is not an inverse update step),
    the run equals the uninterrupted one exactly with include_second_order;
    without it the inverses are recomputed from factors that already hold
    step 3's batch, and the run drifts."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    kw = {**KW, "factor_update_steps": 1}
    whole = fit(tmp_path / "whole", 2, KFACCallback(**kw))
    fit(tmp_path / "first", 1, KFACCallback(include_second_order=second_order, **kw))
    ckpt = tmp_path / "first" / "epoch1.ckpt"
    callback = KFACCallback(include_second_order=second_order, **kw)
    resumed = fit(tmp_path / "resumed", 2, callback, ckpt_path=ckpt)
    assert callback.preconditioner is not None and callback.preconditioner.steps == 2 * STEPS
    want = [p.detach() for p in whole.net.parameters()]
    if second_order:
        assert_close(list(resumed.net.parameters()), want, tol=0.0)
    else:
        with pytest.raises(AssertionError, match="relative error"):
            assert_close(list(resumed.net.parameters()), want, tol=1e-6)


def test_include_second_order_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="include_second_order"):
        KFACCallback(include_second_order="yes")
