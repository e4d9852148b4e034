"""The built-in tasks: data shapes and splits, models, metrics and defaults."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from kaisa.config import KFACConfig
from kaisa_lab.cli.schedule import SCHEDULES
from kaisa_lab.tasks import EvalSums, Metric, bits_per_char, get_task, task_names
from kaisa_lab.tasks.base import OPTIMIZERS, REQUIRED_OPTIMIZERS
from kaisa_lab.tasks.cifar import SUBFOLDER, TEST_FILE, load_cifar10
from kaisa_lab.tasks.text import TextLMTask, WindowDataset

from fakes import write_fake_cifar

# ---------------------------------------------------------------- registry/defaults


ALL_TASKS = [
    "digits-mlp",
    "digits-cnn",
    "text-lm",
    "cifar10",
    "digits-ae",
    "text-cnn",
    "text-lm-large",
]


def test_registry_lists_the_seven_tasks_and_rejects_unknown_names() -> None:
    assert task_names() == ALL_TASKS
    for name in task_names():
        assert get_task(name).name == name
    with pytest.raises(KeyError, match="digits-mlp"):
        get_task("mnist")


@pytest.mark.parametrize("name", ALL_TASKS)
def test_defaults_are_valid_for_the_library(name: str) -> None:
    task = get_task(name)
    defaults = task.defaults
    assert defaults.optimizer in OPTIMIZERS
    # sgd, adam, adamw always; today's baselines where the task tuned them
    assert set(REQUIRED_OPTIMIZERS) <= set(defaults.lr) <= set(OPTIMIZERS)
    assert set(REQUIRED_OPTIMIZERS) <= set(defaults.weight_decay) <= set(OPTIMIZERS)
    assert all(v > 0 for v in defaults.lr.values())
    assert defaults.epochs >= 1 and defaults.batch_size >= 1
    # The CLI's schedule must accept every arm's schedule and warm-up.
    for kfac in (False, True):
        for name in OPTIMIZERS:
            lr, schedule, warmup_epochs = task.arm(kfac, name)
            assert lr > 0 and schedule in SCHEDULES
            assert 0 <= warmup_epochs <= defaults.epochs
            # The preconditioner must follow the optimizer's lr, so no knob pins it.
            knobs = task.kfac_for(name)
            assert "lr" not in knobs
            KFACConfig.from_options(loss_average=task.loss_average, **knobs)


def test_text_lm_averages_its_loss_over_batch_and_sequence() -> None:
    assert get_task("text-lm").loss_average == "batch_and_sequence"
    assert get_task("text-cnn").loss_average == "batch_and_sequence"
    assert get_task("text-lm-large").loss_average == "batch_and_sequence"
    assert get_task("digits-mlp").loss_average == "batch"


# ---------------------------------------------------------------- digits


@pytest.mark.parametrize(
    ("name", "sample_shape"), [("digits-mlp", (64,)), ("digits-cnn", (1, 8, 8))]
)
def test_digits_split_shapes_dtypes_and_model_output(
    name: str, sample_shape: tuple[int, ...]
) -> None:
    task = get_task(name)
    data = task.load()
    assert (len(data.train), len(data.test)) == (1437, 360)
    x, y = data.train.get_batch(torch.arange(len(data.train)))
    assert x.shape == (1437, *sample_shape) and x.dtype == torch.float32
    assert y.shape == (1437,) and y.dtype == torch.int64
    # Standardised with training statistics.
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1.0) < 1e-3
    # Stratified: every class is 10% of the test set, give or take one image.
    _, y_test = data.test.get_batch(torch.arange(len(data.test)))
    counts = torch.bincount(y_test, minlength=10)
    assert int(counts.min()) >= 35 and int(counts.max()) <= 37
    torch.manual_seed(0)
    model = task.build_model()
    assert model(x[:5]).shape == (5, 10)


def test_digits_split_is_deterministic_and_shared_by_both_tasks() -> None:
    mlp, cnn = get_task("digits-mlp").load(), get_task("digits-cnn").load()
    again = get_task("digits-mlp").load()
    idx = torch.arange(len(mlp.test))
    x_mlp, y_mlp = mlp.test.get_batch(idx)
    x_cnn, y_cnn = cnn.test.get_batch(idx)
    x_again, y_again = again.test.get_batch(idx)
    assert torch.equal(x_mlp, x_again) and torch.equal(y_mlp, y_again)
    assert torch.equal(x_mlp, x_cnn.flatten(1)) and torch.equal(y_mlp, y_cnn)


def test_digits_cnn_is_a_resnet_with_batchnorm_convs_and_linear_head() -> None:
    model = get_task("digits-cnn").build_model()
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(nn.Conv2d) >= 3
    assert nn.BatchNorm2d in kinds
    assert isinstance(list(model.modules())[-1], nn.Linear)


def test_build_model_is_reproducible_under_a_seed() -> None:
    task = get_task("digits-cnn")
    torch.manual_seed(3)
    a = task.build_model().state_dict()
    torch.manual_seed(3)
    b = task.build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_digits_autoencoder_reconstructs_its_input_with_a_summed_pixel_loss() -> None:
    task = get_task("digits-ae")
    data = task.load()
    x, y = data.train.get_batch(torch.arange(5))
    assert x.shape == (5, 64) and torch.equal(x, y)  # the target is the image itself
    # the same images as the classification tasks, flattened
    ref, _ = get_task("digits-mlp").load().train.get_batch(torch.arange(5))
    assert torch.equal(x, ref)
    torch.manual_seed(0)
    model = task.build_model()
    widths = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert widths == [256, 128, 32, 8, 32, 128, 256, 64]
    # tanh after every layer but the code (a linear bottleneck) and the output
    kinds = [type(m).__name__ for m in model]
    assert kinds.count("Tanh") == 6 and kinds[-1] == "Linear" and kinds[7] == "Linear"
    with torch.no_grad():
        out = model(x)
    # squared error summed over pixels, averaged over images: loss_average "batch"
    loss = task.loss(out, y)
    manual = sum(float(((out[i] - y[i]) ** 2).sum()) for i in range(5)) / 5
    assert task.loss_average == "batch" and math.isclose(float(loss), manual, rel_tol=1e-5)
    # the metric is the same error per pixel; its sums add over shards
    halves = task.eval_sums(out[:2], y[:2]).as_tensor() + task.eval_sums(out[2:], y[2:]).as_tensor()
    summary = task.summarize(EvalSums.from_tensor(halves))
    assert math.isclose(summary["mse"], manual / 64, rel_tol=1e-5)
    assert math.isclose(summary["loss"], manual, rel_tol=1e-5)
    assert not task.metric.higher_is_better and task.metric.reached(0.1, task.target)


# ---------------------------------------------------------------- text


def test_text_lm_windows_shift_targets_by_one_and_tile_validation() -> None:
    task = TextLMTask()
    data = task.load()
    vocab, context = len(task.vocabulary()), task.context
    x, y = data.train.get_batch(torch.tensor([0, 5, 1000]))
    assert x.shape == y.shape == (3, context) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[1, :-5], x[0, 5:])  # window 5 starts 5 characters later
    assert int(x.max()) < vocab
    # ~10% of the corpus, in non-overlapping windows.
    n_train, n_val = len(data.train) + context, len(data.test) * context
    assert 0.09 < n_val / (n_train + n_val) < 0.11
    xv, _ = data.test.get_batch(torch.tensor([0, 1]))
    assert not torch.equal(xv[0], xv[1])
    again_x, _ = task.load().train.get_batch(torch.tensor([0, 5, 1000]))
    assert torch.equal(x, again_x)


def test_window_dataset_strides_and_covers_every_token_once() -> None:
    tokens = torch.arange(21)
    ds = WindowDataset(tokens, context=4, stride=4)
    assert len(ds) == 5
    x, y = ds.get_batch(torch.arange(len(ds)))
    assert torch.equal(y.flatten(), torch.arange(1, 21))
    assert torch.equal(x.flatten(), torch.arange(0, 20))
    with pytest.raises(ValueError, match="longer than the context"):
        WindowDataset(torch.arange(4), context=4)


def test_text_lm_model_shape_projections_and_causality() -> None:
    task = TextLMTask()
    torch.manual_seed(0)
    model = task.build_model().eval()
    vocab, context = len(task.vocabulary()), task.context
    idx = torch.randint(0, vocab, (2, context))
    out = model(idx)
    assert out.shape == (2, context, vocab)
    # Changing the last token must not change any earlier prediction.
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % vocab
    out2 = model(changed)
    torch.testing.assert_close(out[:, :-1], out2[:, :-1])
    assert not torch.allclose(out[:, -1], out2[:, -1])
    # nn.TransformerEncoderLayer blocks: K-FAC preconditions the attention's
    # projections and the embeddings too (LayerNorms are left to the optimizer)
    from kaisa import KFACPreconditioner

    names = set(KFACPreconditioner(model.train()).layers)
    for role in ("q", "k", "v", "out_proj"):
        assert f"blocks.0.self_attn.{role}" in names
    assert {"tok", "pos", "blocks.0.linear1", "blocks.0.linear2", "head"} <= names


def test_text_cnn_model_is_causal_over_its_receptive_field() -> None:
    """A change at position t moves predictions t .. t+30 and nothing before or after."""
    task = get_task("text-cnn")
    torch.manual_seed(0)
    model = task.build_model().eval()
    vocab, context = len(task.vocabulary()), task.context
    assert model.receptive_field == 31
    idx = torch.randint(0, vocab, (2, context))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % vocab
    moved = (model(changed) - model(idx)).abs().amax(dim=(0, 2)) > 0
    assert moved.tolist() == [20 <= t <= 50 for t in range(context)]
    # the same corpus and windows as text-lm
    assert task.load().train.get_batch(torch.tensor([7]))[0].shape == (1, context)
    from kaisa import KFACPreconditioner

    names = set(KFACPreconditioner(model.train()).layers)
    convs = {f"blocks.{i}.{role}" for i in range(4) for role in ("conv", "proj")}
    assert names == {"tok", "head", *convs}


def test_text_lm_large_is_text_lm_wider_deeper_and_scored_on_a_fixed_slice() -> None:
    """4 blocks of width 256, text-lm's training windows, and the first 256 of
    text-lm's validation windows (the same tiling, cut short to keep the metric cheap)."""
    large, small = get_task("text-lm-large"), TextLMTask()
    data, ref = large.load(), small.load()
    assert len(data.train) == len(ref.train)
    idx = torch.tensor([0, 17, 100_000])
    assert all(
        torch.equal(a, b) for a, b in zip(data.train.get_batch(idx), ref.train.get_batch(idx))
    )
    assert len(data.test) == 256 < len(ref.test)
    every = torch.arange(256)
    assert all(
        torch.equal(a, b) for a, b in zip(data.test.get_batch(every), ref.test.get_batch(every))
    )
    torch.manual_seed(0)
    model = large.build_model()
    assert len(model.blocks) == 4 and model.tok.embedding_dim == 256
    assert model.blocks[0].self_attn.num_heads == 4
    assert 3_000_000 < sum(p.numel() for p in model.parameters()) < 3_500_000


@pytest.mark.parametrize("kfac", [False, True])
def test_text_lm_large_loss_falls_in_a_few_steps(kfac: bool) -> None:
    """A few steps of the task's AdamW (with and without K-FAC at the task's
    settings) on one batch lower its loss: the model, loss and defaults train."""
    from kaisa import KFACPreconditioner

    task = get_task("text-lm-large")
    x, y = task.load().train.get_batch(torch.arange(0, 32 * 997, 997))
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=task.defaults.lr["adamw"])
    kwargs: dict[str, Any] = {**task.kfac_for("adamw"), "factor_update_steps": 1}
    kwargs["inv_update_steps"] = 2
    kwargs["loss_average"] = task.loss_average
    precond = KFACPreconditioner(model, optimizer=opt, **kwargs) if kfac else None
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = task.loss(model(x), y)
        loss.backward()
        if precond is not None:
            precond.step()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses


def test_bits_per_char_conversion() -> None:
    assert bits_per_char(math.log(2.0)) == pytest.approx(1.0)
    assert bits_per_char(math.log(256.0)) == pytest.approx(8.0)
    task = get_task("text-lm")
    summary = task.summarize(EvalSums(loss_sum=10 * math.log(4.0), correct=3, count=10))
    assert summary["bits_per_char"] == pytest.approx(2.0)
    assert summary["loss"] == pytest.approx(math.log(4.0))
    assert task.metric == Metric("bits_per_char", higher_is_better=False)


# ---------------------------------------------------------------- metrics


def test_eval_sums_of_known_logits() -> None:
    task = get_task("digits-mlp")
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    labels = torch.tensor([0, 1, 1])
    sums = task.eval_sums(logits, labels)
    expected = float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
    assert sums.loss_sum == pytest.approx(expected)
    assert (sums.correct, sums.count) == (2.0, 3.0)
    assert task.summarize(sums)["accuracy"] == pytest.approx(2 / 3)
    round_trip = EvalSums.from_tensor(sums.as_tensor())
    assert round_trip == sums


def test_metric_reached_respects_direction() -> None:
    assert Metric("accuracy", True).reached(0.97, 0.97)
    assert not Metric("accuracy", True).reached(0.96, 0.97)
    assert Metric("bits_per_char", False).reached(2.4, 2.5)
    assert not Metric("bits_per_char", False).reached(2.6, 2.5)


# ---------------------------------------------------------------- cifar10


@pytest.mark.parametrize("point_at", ["parent", "subfolder"])
def test_cifar10_reads_pickle_batches(tmp_path: Path, point_at: str) -> None:
    first = write_fake_cifar(tmp_path / SUBFOLDER)
    data_dir = tmp_path if point_at == "parent" else tmp_path / SUBFOLDER
    x_train, y_train, x_test, y_test = load_cifar10(data_dir)
    assert x_train.shape == (20, 3, 32, 32) and x_train.dtype == torch.uint8
    assert x_test.shape == (3, 3, 32, 32)
    assert y_train.shape == (20,) and y_train.dtype == torch.int64 and y_test.shape == (3,)
    # Rows are R(1024) G(1024) B(1024), each row-major 32x32.
    assert int(x_train[1, 2, 3, 4]) == int(first[1, 2 * 1024 + 3 * 32 + 4])
    task = get_task("cifar10")
    data = task.load(data_dir)
    x, y = data.train.get_batch(torch.tensor([0, 1]))
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    assert torch.equal(y, y_train[:2])
    assert task.build_model()(x).shape == (2, 10)


def test_cifar10_missing_files_give_a_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / SUBFOLDER
    write_fake_cifar(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        get_task("cifar10").load(None)
    with pytest.raises(FileNotFoundError, match="test_batch"):
        load_cifar10(tmp_path / "empty")


def test_cifar10_rejects_a_file_of_the_wrong_format(tmp_path: Path) -> None:
    folder = tmp_path / SUBFOLDER
    write_fake_cifar(folder)
    with (folder / TEST_FILE).open("wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), dtype=np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match="3072"):
        load_cifar10(folder)


def _pickled(batch: Any) -> bytes:
    return pickle.dumps(batch)


GOOD_DATA = np.zeros((2, 3072), dtype=np.uint8)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\x00garbage that is no pickle", "not a readable CIFAR-10 batch"),
        (b"", "not a readable CIFAR-10 batch"),  # empty
        (_pickled({b"data": GOOD_DATA, b"labels": [0, 1]})[:-40], "not a readable"),  # truncated
        (_pickled([1, 2, 3]), "no b'data'/b'labels'"),
        (
            _pickled({b"data": GOOD_DATA, b"labels": [0, 10]}),
            "every label must be an integer in 0..9",
        ),
        (_pickled({b"data": GOOD_DATA, b"labels": [0, -1]}), "every label"),
        (_pickled({b"data": GOOD_DATA.astype(np.int64) + 300, b"labels": [0, 1]}), "every pixel"),
        (_pickled({b"data": GOOD_DATA.astype(np.float32), b"labels": [0, 1]}), "every pixel"),
        (_pickled({b"data": GOOD_DATA, b"labels": [0.5, 1.0]}), "every label"),
        (_pickled({b"data": "text", b"labels": [0, 1]}), "no b'data'/b'labels'"),
    ],
)
def test_cifar10_names_a_garbled_file(tmp_path: Path, content: bytes, why: str) -> None:
    folder = tmp_path / SUBFOLDER
    write_fake_cifar(folder)
    (folder / TEST_FILE).write_bytes(content)
    with pytest.raises(ValueError, match=why) as err:
        load_cifar10(folder)
    assert TEST_FILE in str(err.value)


def test_cifar10_reads_integer_pixels_of_any_width(tmp_path: Path) -> None:
    """int64 pixels in 0..255 (a batch re-saved by numpy code) read as the same uint8 images."""
    folder = tmp_path / SUBFOLDER
    write_fake_cifar(folder)
    data = np.arange(2 * 3072, dtype=np.int64).reshape(2, 3072) % 256
    (folder / TEST_FILE).write_bytes(_pickled({b"data": data, b"labels": [3, 9]}))
    _, _, x_test, y_test = load_cifar10(folder)
    assert torch.equal(x_test.flatten(1), torch.as_tensor(data, dtype=torch.uint8))
    assert y_test.tolist() == [3, 9]
