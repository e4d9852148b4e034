"""The layer adapter interface: one canonical shape before any K-FAC math.

An adapter knows how one module type maps its inputs and output gradients to
the canonical ``[rows, features]`` matrices that :mod:`kaisa.factors` turns
into Kronecker factors, and how its parameters' gradients map to the
``[d_out, d_in(+1)]`` matrix that :mod:`kaisa.precondition` preconditions.
Everything else in kaisa is independent of the module type.

Rows are *positions*: a Linear applied to ``[N, T, d]`` contributes ``N·T``
rows (K-FAC-expand), a Conv2d contributes ``N·H_out·W_out`` unfolded patches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import cast

import torch
from torch import Tensor, nn

__all__ = ["LayerAdapter"]


class LayerAdapter(ABC):
    """Maps one registered module to the canonical K-FAC shapes.

    Attributes:
        name: the module's qualified name in the model (``model.named_modules``).
        module: the module itself.
        has_bias: whether a bias column of ones is appended to the inputs.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.has_bias = getattr(module, "bias", None) is not None

    # -- sizes -------------------------------------------------------------
    @property
    @abstractmethod
    def in_features(self) -> int:
        """Width of the layer's input rows, without the bias column."""

    @property
    @abstractmethod
    def out_features(self) -> int:
        """Width of the layer's output-gradient rows."""

    @property
    def a_dim(self) -> int:
        """Size of the A factor (inputs plus one for the bias)."""
        return self.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Size of the G factor."""
        return self.out_features

    # -- capture -----------------------------------------------------------
    @abstractmethod
    def input_rows(self, x: Tensor) -> Tensor:
        """The layer input as ``[rows, in_features]`` (no bias column)."""

    @abstractmethod
    def grad_output_rows(self, g: Tensor) -> Tensor:
        """The gradient w.r.t. the layer output as ``[rows, out_features]``."""

    @staticmethod
    def batch_size(x: Tensor) -> int:
        """Number of data points in a call: the input's leading dimension."""
        return int(x.shape[0]) if x.dim() > 1 else 1

    def a_rows(self, x: Tensor) -> Tensor:
        """Input rows with the bias column of ones appended when there is a bias."""
        rows = self.input_rows(x)
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        return rows

    # -- parameters --------------------------------------------------------
    @property
    def weight(self) -> nn.Parameter:
        return cast(nn.Parameter, self.module.weight)

    @property
    def bias(self) -> nn.Parameter | None:
        return cast("nn.Parameter | None", getattr(self.module, "bias", None))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this adapter preconditions."""
        bias = self.bias
        return [self.weight] if bias is None else [self.weight, bias]

    def grads_to_matrix(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        """``[d_out, d_in(+1)]`` gradient matrix; bias as the last column."""
        mat = weight_grad.reshape(weight_grad.shape[0], -1)
        if bias_grad is not None:
            mat = torch.cat([mat, bias_grad.reshape(-1, 1)], dim=1)
        return mat

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        """Inverse of :meth:`grads_to_matrix`, shaped like the parameters."""
        weight, bias = self.weight, self.bias
        if bias is not None:
            return mat[:, :-1].reshape(weight.shape), mat[:, -1].reshape(bias.shape)
        return mat.reshape(weight.shape), None

    def describe(self) -> str:
        a, g = self.a_dim, self.g_dim
        return f"{type(self.module).__name__}(A: {a}×{a}, G: {g}×{g})"
