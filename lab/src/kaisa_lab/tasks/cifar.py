"""CIFAR-10 image classification from the standard python-pickle batches.

Nothing is downloaded: the data must already be on disk (``--data-dir``), either
the ``cifar-10-batches-py`` folder itself or its parent. Images stay uint8 in
memory and are normalised per batch.

The batches are Python pickles, and unpickling runs code chosen by whoever
wrote the file: only point ``--data-dir`` at a copy you trust.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from torch import nn

from kaisa_lab.tasks.base import ArrayDataset, Defaults, Metric, Task, TaskData
from kaisa_lab.tasks.resnet import SmallResNet

__all__ = ["TRAIN_FILES", "Cifar10Task", "find_cifar10_dir", "load_cifar10"]

SUBFOLDER = "cifar-10-batches-py"
TRAIN_FILES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
# Per-channel statistics of the CIFAR-10 training set (the usual constants).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def find_cifar10_dir(data_dir: Path | str | None) -> Path:
    """Return the folder holding the batch files, or raise a clear FileNotFoundError."""
    if data_dir is None:
        raise FileNotFoundError(
            f"cifar10 needs --data-dir pointing at the '{SUBFOLDER}' folder (or its parent) "
            "with data_batch_1..5 and test_batch; nothing is downloaded"
        )
    root = Path(data_dir).expanduser()
    expected = (*TRAIN_FILES, TEST_FILE)
    candidates = (root, root / SUBFOLDER)
    for folder in candidates:
        if all((folder / name).is_file() for name in expected):
            return folder
    # Report what is missing from whichever candidate holds more of the files.
    closest = max(candidates, key=lambda d: sum((d / n).is_file() for n in expected))
    missing = [n for n in expected if not (closest / n).is_file()]
    raise FileNotFoundError(
        f"CIFAR-10 batches not found in {root} or {root / SUBFOLDER}: {closest} lacks "
        f"{', '.join(missing)} (expected the python-pickle version: data_batch_1..5 and "
        "test_batch; nothing is downloaded)"
    )


#: what unpickling a file that is not a pickle (truncated, another format) raises
_UNREADABLE = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    ImportError,
    IndexError,
    KeyError,
    UnicodeDecodeError,
    OverflowError,
    MemoryError,
)


def _read_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch file's images and labels; any file that is not a CIFAR-10 batch
    (garbled, truncated, pixels or labels out of range) is a ValueError naming it,
    so ``kaisa train --data-dir`` reports it instead of failing mid-training."""
    try:
        with path.open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except _UNREADABLE as err:
        raise ValueError(
            f"{path} is not a readable CIFAR-10 batch (a python pickle): "
            f"{type(err).__name__}: {err}"
        ) from err
    try:
        data, labels = batch[b"data"], batch[b"labels"]
        pixels, targets = torch.as_tensor(data), torch.as_tensor(list(labels))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path} is not a CIFAR-10 batch (no b'data'/b'labels' arrays)") from err
    if pixels.dim() != 2 or pixels.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: expected data of shape [N, 3072], got {tuple(pixels.shape)}")
    if targets.numel() != pixels.shape[0]:
        raise ValueError(f"{path}: {pixels.shape[0]} images but {targets.numel()} labels")
    for what, values, top in (("pixel", pixels, 255), ("label", targets, 9)):
        fractional = values.is_floating_point() or values.is_complex() or values.dtype == torch.bool
        if fractional or (values.numel() and (values.min() < 0 or values.max() > top)):
            raise ValueError(f"{path}: every {what} must be an integer in 0..{top}")
    return pixels.to(torch.uint8).view(-1, 3, 32, 32), targets.to(torch.int64)


def load_cifar10(
    data_dir: Path | str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x_train, y_train, x_test, y_test)``; images uint8 ``[N, 3, 32, 32]``."""
    folder = find_cifar10_dir(data_dir)
    parts = [_read_batch(folder / name) for name in TRAIN_FILES]
    x_test, y_test = _read_batch(folder / TEST_FILE)
    x_train = torch.cat([x for x, _ in parts])
    y_train = torch.cat([y for _, y in parts])
    return x_train, y_train, x_test, y_test


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 3, 32, 32]`` to float32 with zero mean and unit variance per channel."""
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (images.float() / 255.0 - mean) / std


class Cifar10Task(Task):
    """A three-stage small ResNet (widths 32/64/128) on CIFAR-10, no augmentation."""

    name = "cifar10"
    description = "small ResNet on CIFAR-10 (needs --data-dir), scored by test accuracy"
    metric = Metric("accuracy", higher_is_better=True)
    target = 0.75
    defaults = Defaults(
        epochs=20,
        batch_size=128,
        lr={"sgd": 0.1, "adam": 0.001, "adamw": 0.001},
        weight_decay={"sgd": 5e-4, "adam": 0.0, "adamw": 0.05},
        eval_batch_size=1000,
    )

    widths = (32, 64, 128)

    def load(self, data_dir: Path | None = None) -> TaskData:
        x_train, y_train, x_test, y_test = load_cifar10(data_dir)
        return TaskData(
            train=ArrayDataset(x_train, y_train, transform=normalize),
            test=ArrayDataset(x_test, y_test, transform=normalize),
        )

    def build_model(self) -> nn.Module:
        return SmallResNet(in_channels=3, num_classes=10, widths=self.widths)
