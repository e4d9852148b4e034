"""``nn.Conv2d``: unfolded patches with the layer's own padding, stride and dilation."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter

__all__ = ["Conv2dAdapter"]


class Conv2dAdapter(LayerAdapter):
    """A Conv2d layer with ``groups == 1`` (grouped convolutions are refused at
    registration, see :mod:`kaisa.layers.registry`).

    The patches are built exactly as the convolution sees them: the input is
    padded with the module's own ``padding_mode`` (zeros, reflect, replicate,
    circular) and its own — possibly asymmetric, for ``padding='same'`` —
    padding amounts, then unfolded with the module's kernel size, dilation and
    stride.  Each output position is one row (K-FAC-expand over positions).
    """

    module: nn.Conv2d

    @property
    def in_features(self) -> int:
        kh, kw = self.module.kernel_size
        return int(self.module.in_channels * kh * kw)

    @property
    def out_features(self) -> int:
        return int(self.module.out_channels)

    def _padded(self, x: Tensor) -> Tensor:
        pad = self.module._reversed_padding_repeated_twice
        if not any(pad):
            return x
        mode = self.module.padding_mode
        return F.pad(x, pad, mode="constant" if mode == "zeros" else mode)

    @staticmethod
    def batch_size(x: Tensor) -> int:
        return int(x.shape[0]) if x.dim() == 4 else 1

    def input_rows(self, x: Tensor) -> Tensor:
        if x.dim() == 3:  # unbatched [C, H, W]
            x = x.unsqueeze(0)
        patches = F.unfold(
            self._padded(x),
            kernel_size=self.module.kernel_size,
            dilation=self.module.dilation,
            stride=self.module.stride,
        )  # [N, C·kh·kw, L]
        return patches.transpose(1, 2)  # [N, L, C·kh·kw]

    def grad_output_rows(self, g: Tensor) -> Tensor:
        if g.dim() == 3:
            g = g.unsqueeze(0)
        return g.flatten(2).transpose(1, 2)  # [N, H_out·W_out, C_out]
