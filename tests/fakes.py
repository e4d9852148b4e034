"""Small files in the formats of datasets this machine does not have."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from kaisa_lab.tasks.cifar import TEST_FILE, TRAIN_FILES


def write_fake_cifar(folder: Path, per_batch: int = 4, n_test: int = 3) -> np.ndarray:
    """Write tiny batches in the real format; returns the first training batch's data."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    first = None
    for name, n in [*((f, per_batch) for f in TRAIN_FILES), (TEST_FILE, n_test)]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        with (folder / name).open("wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
        first = data if first is None else first
    assert first is not None
    return first
