"""``nn.Conv1d``, and the ``Conv1D`` of Hugging Face GPT-2 (a Linear whose
weight is stored ``[in, out]``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter
from kaisa.layers.linear import LinearAdapter

__all__ = ["Conv1dAdapter", "TransposedLinearAdapter"]


class Conv1dAdapter(LayerAdapter):
    """A Conv1d layer with ``groups == 1``: the patches of the module's own
    padding (any ``padding_mode``, ``'same'``), dilation and stride, each
    output position one row — the Conv2d construction on a height of 1."""

    module: nn.Conv1d

    @property
    def in_features(self) -> int:
        return int(self.module.in_channels * self.module.kernel_size[0])

    @property
    def out_features(self) -> int:
        return int(self.module.out_channels)

    @staticmethod
    def batch_size(x: Tensor) -> int:
        return int(x.shape[0]) if x.dim() == 3 else 1

    def input_rows(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # unbatched [C, L]
            x = x.unsqueeze(0)
        pad = self.module._reversed_padding_repeated_twice
        if any(pad):
            mode = self.module.padding_mode
            x = F.pad(x, pad, mode="constant" if mode == "zeros" else mode)
        patches = F.unfold(
            x.unsqueeze(2),
            kernel_size=(1, self.module.kernel_size[0]),
            dilation=(1, self.module.dilation[0]),
            stride=(1, self.module.stride[0]),
        )  # [N, C·k, L_out]
        return patches.transpose(1, 2)

    def grad_output_rows(self, g: Tensor) -> Tensor:
        if g.dim() == 2:
            g = g.unsqueeze(0)
        return g.transpose(1, 2)  # [N, L_out, C_out]


class TransposedLinearAdapter(LinearAdapter):
    """Hugging Face's ``Conv1D`` (GPT-2): ``y = x @ W + b`` with ``W`` stored
    ``[in, out]``.  The canonical gradient matrix is ``W.grad.T`` (plus the
    bias column); writing back transposes again."""

    @property
    def in_features(self) -> int:
        return int(self.module.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.module.weight.shape[1])

    def grads_to_matrix(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        return super().grads_to_matrix(weight_grad.t(), bias_grad)

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        bias = self.bias
        weight = mat[:, :-1] if bias is not None else mat
        return weight.t(), (mat[:, -1].reshape(bias.shape) if bias is not None else None)
