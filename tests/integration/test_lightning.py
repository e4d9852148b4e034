"""Lightning's KFACCallback gives the parameters of the plain torch loop with kaisa."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from kaisa import KFACPreconditioner  # noqa: E402
from kaisa.integrations.lightning import KFACCallback  # noqa: E402

from framework_case import (  # noqa: E402
    ACCUMULATE,
    BAD_CALLBACK_OPTIONS,
    KW,
    STEPS,
    assert_close,
    check_refused_when_made,
    make_net,
    micro_batches,
    plain_loop,
)
from lightning_case import Module  # noqa: E402


def make_trainer(
    tmp_path, callback: KFACCallback, accumulate: int = ACCUMULATE, **limits
) -> pl.Trainer:
    """A float64 CPU Trainer with the callback, accumulating ``accumulate`` micro-batches."""
    return pl.Trainer(
        **limits,
        accelerator="cpu",
        devices=1,
        precision="64-true",
        accumulate_grad_batches=accumulate,
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


def _two_optimizers(net: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """SGD on the first layer's weight (as Muon takes the hidden matrices),
    AdamW on the rest."""
    first = [net[0].weight]
    rest = [p for p in net.parameters() if p is not net[0].weight]
    return [
        torch.optim.SGD(first, lr=0.1, momentum=0.9),
        torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1),
    ]


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers; batch ``NAN`` has a NaN loss."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.net = make_net()
        self.automatic_optimization = False
        self.nan_at = nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        opts = self.optimizers()
        for opt in opts:
            opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if batch_idx == self.nan_at:
            loss = loss * float("nan")
        self.manual_backward(loss)
        for opt in opts:
            opt.step()

    def configure_optimizers(self):
        return _two_optimizers(self.net)


def _two_optimizer_loop(nan_at: int | None) -> list[torch.Tensor]:
    net = make_net()
    opts = _two_optimizers(net)
    precond = KFACPreconditioner(net, optimizer=opts, **KW)
    for i, (x, y) in enumerate(micro_batches()):
        for opt in opts:
            opt.zero_grad()
        if i == nan_at:  # the step kaisa skips, left out by the loop itself
            continue
        torch.nn.functional.cross_entropy(net(x), y).backward()
        precond.step()
        for opt in opts:
            opt.step()
    return [p.detach() for p in net.parameters()]


@pytest.mark.parametrize(
    "nan_at, lr", [(None, None), (3, None), (3, 0.1)], ids=["finite", "nan", "nan-lr-given"]
)
def test_two_optimizers_precondition_once_a_batch_and_skip_a_nan_step(
    tmp_path, nan_at: int | None, lr: float | None
) -> None:
    """Each optimizer's step fires the hook; kaisa preconditions once a batch,
    reads the first optimizer's lr, and a NaN batch changes neither optimizer's
    parameters, also where lr= is given (it sets the KL clip's lr only: the
    first optimizer's, 0.1, here)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = TwoOptimizers(nan_at)
    callback = KFACCallback(**KW) if lr is None else KFACCallback(**KW, lr=lr)
    trainer = make_trainer(
        tmp_path, callback, accumulate=1, max_epochs=1
    )  # manual: no accumulation
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the NaN step's report
        trainer.fit(module, loader)
    assert callback.preconditioner is not None
    assert callback.preconditioner.steps == len(micro_batches()) - (nan_at is not None)
    got = list(module.net.parameters())
    assert all(torch.isfinite(p).all() for p in got)
    assert_close(got, _two_optimizer_loop(nan_at), tol=0.0)


@pytest.mark.parametrize(("options", "error", "match"), BAD_CALLBACK_OPTIONS)
def test_the_callbacks_options_are_checked_when_it_is_made(options, error, match) -> None:
    check_refused_when_made(KFACCallback, options, error, match)


def test_a_fit_cut_short_by_an_exception_leaves_no_hooks_behind(tmp_path) -> None:
    """A fit() that raised never reached on_fit_end: the next fit() builds a
    new preconditioner and takes the old one's hooks (and its optimizer
    verdict) off the model; they stayed and captured every later forward."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Crash(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("out of memory, say")

    module = Module()
    callback = KFACCallback(**KW)
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    crashing = make_trainer(tmp_path, callback, max_steps=STEPS)
    crashing.callbacks.append(Crash())
    with pytest.raises(RuntimeError, match="out of memory"):
        crashing.fit(module, loader)
    first = callback.preconditioner
    make_trainer(tmp_path, callback, max_steps=STEPS).fit(module, loader)
    assert callback.preconditioner is not first
    x, y = micro_batches()[0]
    torch.nn.functional.cross_entropy(module.net(x), y).backward()
    with pytest.raises(RuntimeError, match="remove_hooks"):
        first.step()


def test_accumulation_steps_none_is_the_trainers(tmp_path) -> None:
    """``accumulation_steps=None`` means ``accumulate_grad_batches``, as
    leaving it out does (it meant 1)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    callback = KFACCallback(**{**KW, "accumulation_steps": None})
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    make_trainer(tmp_path, callback, max_steps=STEPS).fit(Module(), loader)
    assert callback.preconditioner is not None
    assert callback.preconditioner.accumulation_steps == ACCUMULATE
