"""The Hugging Face Trainer's KFACCallback gives the parameters of the plain loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from kaisa import KFACPreconditioner  # noqa: E402
from kaisa.integrations.transformers import KFACCallback  # noqa: E402

from framework_case import BAD_CALLBACK_OPTIONS, check_refused_when_made  # noqa: E402

KW = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2)
ACCUMULATE = 2
STEPS = 3
BATCH = 4


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACCUMULATE * BATCH
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


class InOrder(transformers.Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def plain_loop() -> list[torch.Tensor]:
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    data = rows()
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(ACCUMULATE):
            start = (step * ACCUMULATE + k) * BATCH
            chunk = data[start : start + BATCH]
            x = torch.stack([r["x"] for r in chunk])
            y = torch.stack([r["labels"] for r in chunk])
            (model(x, y)["loss"] / ACCUMULATE).backward()
        precond.step()
        opt.step()
    return [p.detach() for p in model.parameters()]


def training_arguments(
    tmp_path, max_grad_norm: float, **extra: object
) -> transformers.TrainingArguments:
    """Plain SGD at a constant rate, in order, nothing saved or logged."""
    return transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=max_grad_norm,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **extra,
    )


def trainer_run(tmp_path, max_grad_norm: float) -> tuple[list[torch.Tensor], KFACCallback]:
    model = Classifier()
    args = training_arguments(tmp_path, max_grad_norm)
    callback = KFACCallback(**KW)
    InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback]).train()
    return [p.detach() for p in model.parameters()], callback


def test_trainer_callback_equals_plain_loop_with_accumulation(tmp_path) -> None:
    got, callback = trainer_run(tmp_path, max_grad_norm=0.0)
    assert callback.preconditioner is not None and callback.preconditioner.steps == STEPS
    for a, b in zip(got, plain_loop()):
        assert float((a - b).norm() / b.norm()) <= 1e-5  # float32


def test_a_given_lr_still_hands_kaisa_the_optimizer(tmp_path) -> None:
    """lr= sets the KL clip's lr; the Trainer's optimizer is still kaisa's, so
    a step skipped for non-finite gradients empties its gradients."""
    model = Classifier()
    callback = KFACCallback(**{**KW, "lr": 0.05})
    trainer = InOrder(
        model=model,
        args=training_arguments(tmp_path, 0.0),
        train_dataset=rows(),
        callbacks=[callback],
    )
    trainer.train()
    precond = callback.preconditioner
    assert precond is not None and precond.lr == 0.05
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert precond.optimizer is inner


def test_trainer_clipping_before_kfac_warns(tmp_path) -> None:
    with pytest.warns(UserWarning, match="max_grad_norm=1.0"):
        trainer_run(tmp_path, max_grad_norm=1.0)


# -- a Hugging Face language model: loss Σℓ / num_items_in_batch -----------------
VOCAB, LENGTH = 32, 8


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
    )
    return transformers.LlamaForCausalLM(config)


def token_rows() -> list[dict[str, torch.Tensor]]:
    """Sequences with padded (ignored) tails of different lengths, so the token
    count differs between micro-batches and steps."""
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(STEPS * ACCUMULATE * BATCH):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        labels = ids.clone()
        labels[LENGTH - (i % 5) :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def lm_plain_loop() -> tuple[list[torch.Tensor], list[float]]:
    """The loop the Trainer runs: each micro-batch's loss is Σℓ / N with N the
    step's target tokens (labels shifted by one, -100 ignored)."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, accumulation_steps=ACCUMULATE, loss_average="items", **KW
    )
    data = token_rows()
    seen = []
    for step in range(STEPS):
        opt.zero_grad()
        window = data[step * ACCUMULATE * BATCH : (step + 1) * ACCUMULATE * BATCH]
        items = sum(int((r["labels"][1:] != -100).sum()) for r in window)
        precond.loss_items = items
        seen.append(float(items))
        for k in range(ACCUMULATE):
            chunk = window[k * BATCH : (k + 1) * BATCH]
            ids = torch.stack([r["input_ids"] for r in chunk])
            labels = torch.stack([r["labels"] for r in chunk])
            model(
                input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(items)
            ).loss.backward()
        precond.step()
        opt.step()
    return [p.detach() for p in model.parameters()], seen


def test_trainer_language_model_uses_num_items_in_batch(tmp_path) -> None:
    model = tiny_llama()
    args = training_arguments(tmp_path, 0.0)
    callback = KFACCallback(**KW)
    seen: list[float] = []
    original = callback._read_items

    def spy(module, args, kwargs):
        original(module, args, kwargs)
        seen.append(callback.preconditioner.loss_items)

    callback._read_items = spy  # type: ignore[method-assign]
    InOrder(model=model, args=args, train_dataset=token_rows(), callbacks=[callback]).train()
    precond = callback.preconditioner
    assert precond is not None and precond.config.loss_average.value == "items"
    assert any("q_proj" in n for n in precond.layers) and "lm_head" in precond.layers
    want, items = lm_plain_loop()
    assert seen == [n for n in items for _ in range(ACCUMULATE)]
    assert len(set(items)) > 1  # the token count really varies
    for a, b in zip([p.detach() for p in model.parameters()], want):
        assert float((a - b).norm() / b.norm()) <= 1e-5


# -- resuming from a Trainer checkpoint --------------------------------------------
RESUME_KW = {**KW, "factor_update_steps": 1}


def resumable_run(
    tmp_path, second_order: bool, resume: bool
) -> tuple[list[torch.Tensor], KFACCallback]:
    """Two epochs of 3 steps (inverse updates at 0, 2, 4); with ``resume`` the
    first epoch runs, saves at step 3 and a new Trainer resumes from it."""
    args = training_arguments(tmp_path, 0.0)
    args.max_steps = 2 * STEPS
    if resume:
        args.save_strategy = "steps"
        args.save_steps = STEPS
        first = KFACCallback(include_second_order=second_order, **RESUME_KW)
        trainer = InOrder(model=Classifier(), args=args, train_dataset=rows(), callbacks=[first])
        trainer.train()
        assert (tmp_path / f"checkpoint-{STEPS}" / KFACCallback.STATE_NAME).is_file()
    model = Classifier()
    callback = KFACCallback(include_second_order=second_order, **RESUME_KW)
    trainer = InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{STEPS}") if resume else None)
    return [p.detach() for p in model.parameters()], callback


@pytest.mark.parametrize("second_order", [True, False])
def test_trainer_resume_between_inverse_updates(tmp_path, second_order: bool) -> None:
    want, _ = resumable_run(tmp_path / "whole", second_order, resume=False)
    got, callback = resumable_run(tmp_path / "resumed", second_order, resume=True)
    assert callback.preconditioner is not None and callback.preconditioner.steps == 2 * STEPS
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
    if second_order:
        assert max(errors) == 0.0, errors
    else:  # the inverses are recomputed from factors that already hold step 3's batch
        assert max(errors) > 1e-6, errors


def test_a_trainer_trained_again_with_the_same_callback_resumes_exactly(tmp_path) -> None:
    """A second ``train()`` (here resuming the first's checkpoint) builds its
    preconditioner anew and loads the checkpoint's state: the first call's
    end had taken the hooks off, and the second raised at its first step."""
    want, _ = resumable_run(tmp_path / "whole", True, resume=False)
    args = training_arguments(tmp_path / "twice", 0.0)
    args.max_steps, args.save_strategy, args.save_steps = 2 * STEPS, "steps", STEPS
    model = Classifier()
    callback = KFACCallback(**RESUME_KW)
    trainer = InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback])
    trainer.train()
    first = callback.preconditioner
    trainer.train(resume_from_checkpoint=str(tmp_path / "twice" / f"checkpoint-{STEPS}"))
    assert callback.preconditioner is not first
    assert callback.preconditioner is not None and callback.preconditioner.steps == 2 * STEPS
    for a, b in zip([p.detach() for p in model.parameters()], want):
        assert torch.equal(a, b)


def test_resuming_from_a_checkpoint_outside_output_dir_is_exact(tmp_path) -> None:
    """``train(resume_from_checkpoint=path)`` may name any folder; the state
    was looked for under ``output_dir`` and the preconditioner started afresh."""
    import shutil

    want, _ = resumable_run(tmp_path / "whole", True, resume=False)
    resumable_run(tmp_path / "first", True, resume=True)  # writes first/checkpoint-3
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "first" / f"checkpoint-{STEPS}", moved)
    args = training_arguments(tmp_path / "second", 0.0)
    args.max_steps = 2 * STEPS
    model = Classifier()
    callback = KFACCallback(**RESUME_KW)
    trainer = InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback])
    trainer.train(resume_from_checkpoint=str(moved))
    for a, b in zip([p.detach() for p in model.parameters()], want):
        assert torch.equal(a, b)


def test_fp16_grad_scaler_is_divided_out_of_the_factors(tmp_path) -> None:
    """With ``fp16=True`` accelerate scales the loss by a GradScaler (on a GPU;
    here the same scaler is put in its place on the CPU): the factors were
    captured from the scaled backward, so G held the scale squared.  The run
    equals the documented plain loop (``unscale_``, then ``grad_scaler=``)."""
    scale = 2.0**8

    def plain() -> list[torch.Tensor]:
        model = Classifier()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        precond = KFACPreconditioner(
            model, optimizer=opt, accumulation_steps=ACCUMULATE, grad_scaler=scaler, **KW
        )
        data = rows()
        for step in range(STEPS):
            opt.zero_grad()
            for k in range(ACCUMULATE):
                chunk = data[(step * ACCUMULATE + k) * BATCH :][:BATCH]
                x = torch.stack([r["x"] for r in chunk])
                y = torch.stack([r["labels"] for r in chunk])
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(x, y)["loss"]
                scaler.scale(loss / ACCUMULATE).backward()
            scaler.unscale_(opt)
            precond.step()
            scaler.step(opt)
            scaler.update()
        return [p.detach() for p in model.parameters()]

    model = Classifier()
    args = training_arguments(tmp_path, 0.0, fp16=True)
    callback = KFACCallback(**KW)
    trainer = InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback])
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    trainer.accelerator.native_amp = True
    trainer.train()
    assert callback.preconditioner is not None
    assert callback.preconditioner.grad_scaler is trainer.accelerator.scaler
    for a, b in zip([p.detach() for p in model.parameters()], plain()):
        assert float((a - b).norm() / b.norm()) <= 1e-5


def test_a_compute_loss_that_drops_num_items_in_batch_is_told_what_to_pass(tmp_path) -> None:
    """The callback reads ``num_items_in_batch`` for a model taking loss
    keyword arguments; a ``compute_loss`` of one's own that does not pass it
    on met only kaisa's ``loss_items`` error, whose advice a callback user
    cannot follow.  The warning names what to do."""

    class OwnLoss(InOrder):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).loss

    callback = KFACCallback(**KW)
    trainer = OwnLoss(
        model=tiny_llama(),
        args=training_arguments(tmp_path, 0.0),
        train_dataset=token_rows(),
        callbacks=[callback],
    )
    told = pytest.warns(UserWarning, match=r"model.accepts_loss_kwargs = False before building")
    with told, pytest.raises(RuntimeError, match="loss_items"):
        trainer.train()


def test_an_epochs_short_last_step_equals_the_plain_loop(tmp_path) -> None:
    """Five micro-batches at two per step: the epoch's last step has one, and
    the Trainer divides its loss by 1.  kaisa follows the count (its G was
    4 times too large on that step) and equals the plain loop that says so."""
    data = [r for _ in range(2) for r in rows()][: 5 * BATCH]
    model = Classifier()
    args = training_arguments(tmp_path, 0.0, num_train_epochs=1)
    args.max_steps = -1
    callback = KFACCallback(**RESUME_KW)
    InOrder(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert callback.preconditioner is not None and callback.preconditioner.steps == 3

    plain = Classifier()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    precond = KFACPreconditioner(plain, optimizer=opt, accumulation_steps=ACCUMULATE, **RESUME_KW)
    for first in (0, 2, 4):
        micro = [data[i * BATCH : (i + 1) * BATCH] for i in range(first, min(first + 2, 5))]
        precond.accumulation_steps = len(micro)
        opt.zero_grad()
        for chunk in micro:
            x = torch.stack([r["x"] for r in chunk])
            y = torch.stack([r["labels"] for r in chunk])
            (plain(x, y)["loss"] / len(micro)).backward()
        precond.step()
        opt.step()
    assert callback.preconditioner.accumulation_steps == 1
    for a, b in zip(model.parameters(), plain.parameters()):
        assert float((a - b).norm() / b.norm()) <= 1e-5


@pytest.mark.parametrize(("options", "error", "match"), BAD_CALLBACK_OPTIONS)
def test_the_callbacks_options_are_checked_when_it_is_made(options, error, match) -> None:
    check_refused_when_made(KFACCallback, options, error, match)


def test_a_train_cut_short_by_an_exception_then_resumed_is_exact(tmp_path) -> None:
    """A train() that raised never reached on_train_end: the next call, on
    the same Trainer and callback, must still build anew and load the
    checkpoint (it kept the old, hooked preconditioner and loaded nothing)."""

    class Crash(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == STEPS + 1:
                raise RuntimeError("out of memory, say")

    want, _ = resumable_run(tmp_path / "whole", True, resume=False)
    args = training_arguments(tmp_path / "cut", 0.0)
    args.max_steps, args.save_strategy, args.save_steps = 2 * STEPS, "steps", STEPS
    model = Classifier()
    callback = KFACCallback(**RESUME_KW)
    trainer = InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback, Crash])
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    trainer.remove_callback(Crash)
    trainer.train(resume_from_checkpoint=str(tmp_path / "cut" / f"checkpoint-{STEPS}"))
    for a, b in zip([p.detach() for p in model.parameters()], want):
        assert torch.equal(a, b)


class KwargsClassifier(Classifier):
    """Takes ``**kwargs``, as Hugging Face's sequence classifiers do, and
    averages its loss over the micro-batch, ignoring ``num_items_in_batch``."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        return super().forward(x, labels)


def test_a_model_taking_loss_kwargs_with_a_micro_batch_mean_loss(tmp_path) -> None:
    """The Trainer divides neither such a model's loss by the accumulation
    count (it passes num_items_in_batch instead), so loss_average='batch'
    read G (GA)² too large: that is warned about.  Declared with
    ``accepts_loss_kwargs = False`` before the Trainer is built, the Trainer
    divides, the callback reads a batch-averaged loss, and the run equals
    the plain loop."""
    callback = KFACCallback(**{**KW, "loss_average": "batch"})
    trainer = InOrder(
        model=KwargsClassifier(),
        args=training_arguments(tmp_path / "given", 0.0),
        train_dataset=rows(),
        callbacks=[callback],
    )
    with pytest.warns(UserWarning, match="gradient_accumulation_steps² too large"):
        trainer.train()

    model = KwargsClassifier()
    model.accepts_loss_kwargs = False
    callback = KFACCallback(**KW)
    trainer = InOrder(
        model=model,
        args=training_arguments(tmp_path / "declared", 0.0),
        train_dataset=rows(),
        callbacks=[callback],
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in seen if "num_items_in_batch" in str(w.message)]
    assert callback.preconditioner is not None
    assert callback.preconditioner.config.loss_average.value == "batch"
    for a, b in zip([p.detach() for p in model.parameters()], plain_loop()):
        assert float((a - b).norm() / b.norm()) <= 1e-5


def test_accumulation_steps_none_is_the_trainers(tmp_path) -> None:
    """``accumulation_steps=None`` means the Trainer's count, as leaving it out
    does (it meant 1, and stopped the callback following a short last step)."""
    callback = KFACCallback(**{**KW, "accumulation_steps": None})
    trainer = InOrder(
        model=Classifier(),
        args=training_arguments(tmp_path, 0.0),
        train_dataset=rows(),
        callbacks=[callback],
    )
    trainer.train()
    assert callback.preconditioner is not None
    assert callback.preconditioner.accumulation_steps == ACCUMULATE


def test_a_summed_loss_given_for_a_loss_kwargs_model_is_not_warned_about(tmp_path) -> None:
    """loss_average='sum' does not read the accumulation count, so the
    Trainer's leaving the loss undivided is no mismatch to warn about."""
    trainer = InOrder(
        model=KwargsClassifier(),
        args=training_arguments(tmp_path, 0.0),
        train_dataset=rows(),
        callbacks=[KFACCallback(**{**KW, "loss_average": "sum"})],
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in seen if "too large" in str(w.message)]
