"""``nn.Conv2d``: patches with the layer's own padding, stride and dilation."""

from __future__ import annotations

from torch import nn

from kaisa.layers.convolution import ConvAdapter

__all__ = ["Conv2dAdapter"]


class Conv2dAdapter(ConvAdapter):
    """A Conv2d layer with ``groups == 1`` (grouped convolutions are refused at
    registration, see :mod:`kaisa.layers.registry`): rows ``[N, H_out·W_out,
    C·kh·kw]``, factor terms from the channels-last patch view (see
    :mod:`kaisa.layers.convolution` and :mod:`kaisa.layers.patches`)."""

    spatial_dims = 2
    module: nn.Conv2d
