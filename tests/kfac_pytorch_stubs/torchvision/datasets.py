"""``CIFAR10`` of the real shape, synthetic and small, never downloaded.

Images are ``uint8`` arrays of shape 32×32×3 (what the real dataset keeps in
``.data``), labels ``0..9``; each class has its own mean colour plus noise, so
the task is learnable.  Deterministic: the same split gives the same images.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

TRAIN_SIZE = 128
TEST_SIZE = 32


class CIFAR10:
    """``torchvision.datasets.CIFAR10(root, train, download, transform)`` look-alike."""

    classes: ClassVar[list[str]] = [
        "airplane", "automobile", "bird", "cat", "deer",
        "dog", "frog", "horse", "ship", "truck",
    ]  # fmt: skip

    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        download: bool = False,
    ) -> None:
        self.root = root
        self.train = train
        self.transform = transform
        self.target_transform = target_transform
        size = TRAIN_SIZE if train else TEST_SIZE
        rng = np.random.default_rng(0 if train else 1)
        self.targets = [i % 10 for i in range(size)]
        means = np.random.default_rng(2).integers(40, 216, size=(10, 1, 1, 3))
        noise = rng.normal(0.0, 40.0, size=(size, 32, 32, 3))
        self.data = np.clip(means[self.targets] + noise, 0, 255).astype(np.uint8)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = self.data[index]
        target: Any = self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
