"""Tasks on scikit-learn's 8×8 handwritten digits (1797 images, bundled, no download).

Small enough that a whole run takes seconds on a laptop CPU, which makes these
the tasks of the tests and of the demo. The split is stratified and seeded with
a constant, independent of ``--seed``, so every run is scored on the same test
images.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from kaisa_lab.tasks.base import ArrayDataset, Defaults, Metric, Task, TaskData
from kaisa_lab.tasks.resnet import SmallResNet

__all__ = ["DigitsCNNTask", "DigitsMLPTask", "load_digits_split"]

#: Seed of the train/test split; a constant so the test set never changes.
SPLIT_SEED = 0
TEST_FRACTION = 0.2
NUM_CLASSES = 10


@functools.lru_cache(maxsize=1)
def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x_train, y_train, x_test, y_test)`` with images as float32 ``[N, 8, 8]``.

    Pixels (0..16) are standardised with the mean and standard deviation of the
    training images only, so no statistic of the test set leaks into training.
    Cached because both digits tasks (and every run of ``compare``) share it;
    callers must not modify the returned tensors in place.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images, labels = bunch.images, bunch.target
    x_tr, x_te, y_tr, y_te = train_test_split(
        images,
        labels,
        test_size=TEST_FRACTION,
        stratify=labels,
        random_state=SPLIT_SEED,
    )
    x_train = torch.as_tensor(x_tr, dtype=torch.float32)
    x_test = torch.as_tensor(x_te, dtype=torch.float32)
    mean, std = x_train.mean(), x_train.std()
    return (
        (x_train - mean) / std,
        torch.as_tensor(y_tr, dtype=torch.int64),
        (x_test - mean) / std,
        torch.as_tensor(y_te, dtype=torch.int64),
    )


class DigitsMLPTask(Task):
    """A two-hidden-layer MLP on flattened 64-pixel digits."""

    name = "digits-mlp"
    description = "MLP 64-128-128-10 on scikit-learn digits, scored by test accuracy"
    metric = Metric("accuracy", higher_is_better=True)
    target = 0.95
    defaults = Defaults(
        epochs=10,
        batch_size=64,
        lr={"sgd": 0.1, "adam": 0.003, "adamw": 0.003},
    )

    hidden = 128

    def load(self, data_dir: Path | None = None) -> TaskData:
        x_train, y_train, x_test, y_test = load_digits_split()
        return TaskData(
            train=ArrayDataset(x_train.flatten(1), y_train),
            test=ArrayDataset(x_test.flatten(1), y_test),
        )

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, self.hidden),
            nn.ReLU(),
            nn.Linear(self.hidden, NUM_CLASSES),
        )


class DigitsCNNTask(Task):
    """A small ResNet (BatchNorm, residual blocks) on 1×8×8 digit images."""

    name = "digits-cnn"
    description = "small ResNet on 1x8x8 scikit-learn digits, scored by test accuracy"
    metric = Metric("accuracy", higher_is_better=True)
    target = 0.97
    # Two epochs, a cosine after an optional warm-up; the metric is read after
    # every step (23 an epoch, off the clock).
    defaults = Defaults(
        epochs=2,
        batch_size=64,
        evals_per_epoch=23,
        lr={"sgd": 0.1, "adam": 0.003, "adamw": 0.003},
        schedule="cosine",
        warmup_epochs=0.5,
    )

    widths = (32, 64)

    def load(self, data_dir: Path | None = None) -> TaskData:
        x_train, y_train, x_test, y_test = load_digits_split()
        return TaskData(
            train=ArrayDataset(x_train.unsqueeze(1), y_train),
            test=ArrayDataset(x_test.unsqueeze(1), y_test),
        )

    def build_model(self) -> nn.Module:
        return SmallResNet(in_channels=1, num_classes=NUM_CLASSES, widths=self.widths)
