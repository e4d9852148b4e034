"""``nn.Conv1d``, and the ``Conv1D`` of Hugging Face GPT-2 (a Linear whose
weight is stored ``[in, out]``)."""

from __future__ import annotations

from torch import Tensor, nn

from kaisa.layers.convolution import ConvAdapter
from kaisa.layers.linear import LinearAdapter

__all__ = ["Conv1dAdapter", "TransposedLinearAdapter"]


class Conv1dAdapter(ConvAdapter):
    """A Conv1d layer with ``groups == 1``: the patches of the module's own
    padding (any ``padding_mode``, ``'same'``), dilation and stride, each
    output position one row — the Conv2d construction on one spatial
    dimension (see :mod:`kaisa.layers.convolution`)."""

    spatial_dims = 1
    module: nn.Conv1d


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

    def grads_to_matrix(
        self, weight_grad: Tensor, bias_grad: Tensor | None, out: Tensor | None = None
    ) -> Tensor:
        return super().grads_to_matrix(weight_grad.t(), bias_grad, out)

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        bias = self.bias if self.has_bias else None
        weight = mat[:, :-1] if bias is not None else mat
        return weight.t(), (mat[:, -1].reshape(bias.shape) if bias is not None else None)
