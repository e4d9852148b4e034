"""The five transforms the CIFAR-10 example composes, on H×W×C ``uint8`` arrays.

``RandomCrop`` and ``RandomHorizontalFlip`` draw from torch's global generator,
as torchvision's do; ``ToTensor`` gives C×H×W floats in [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


class Compose:
    """Apply the transforms in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class RandomCrop:
    """Zero-pad by ``padding`` on each side, then crop ``size``×``size`` at a random place."""

    def __init__(self, size: int, padding: int = 0) -> None:
        self.size = size
        self.padding = padding

    def __call__(self, image: np.ndarray) -> np.ndarray:
        p = self.padding
        padded = np.pad(image, ((p, p), (p, p), (0, 0)))
        top = int(torch.randint(0, padded.shape[0] - self.size + 1, ()))
        left = int(torch.randint(0, padded.shape[1] - self.size + 1, ()))
        return padded[top : top + self.size, left : left + self.size]


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, image: np.ndarray) -> np.ndarray:
        return image[:, ::-1] if float(torch.rand(())) < self.p else image


class ToTensor:
    """H×W×C ``uint8`` → C×H×W ``float32`` in [0, 1]."""

    def __call__(self, image: np.ndarray) -> torch.Tensor:
        array = np.ascontiguousarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class Normalize:
    """Per-channel ``(x - mean) / std``."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        return (tensor - self.mean) / self.std
