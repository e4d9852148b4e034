"""A small ResNet (He et al. 2016, post-activation blocks) shared by the image tasks.

It exercises the layer types K-FAC cares about in vision models (Conv2d with
and without stride, 1×1 projection shortcuts, a Linear head) next to layers it
leaves alone (BatchNorm, pooling), at a size that trains in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "SmallResNet"]


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm and an identity (or 1×1) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """Stem convolution, one :class:`BasicBlock` per stage, global pooling, Linear head.

    Every stage after the first halves the spatial size and uses the next
    width in ``widths``.
    """

    def __init__(self, in_channels: int, num_classes: int, widths: Sequence[int]) -> None:
        super().__init__()
        if not widths:
            raise ValueError("widths must name at least one stage")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False),
            nn.BatchNorm2d(widths[0]),
            nn.ReLU(),
        )
        blocks: list[nn.Module] = []
        previous = widths[0]
        for i, width in enumerate(widths):
            blocks.append(BasicBlock(previous, width, stride=1 if i == 0 else 2))
            previous = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(previous, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(out), 1))
