"""``nn.Linear``: inputs with any number of leading dimensions (K-FAC-expand)."""

from __future__ import annotations

from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter

__all__ = ["LinearAdapter"]


class LinearAdapter(LayerAdapter):
    """A Linear layer; every leading index of the input is a row.

    For a sequence input ``[N, T, d]`` the ``T`` positions share the weight and
    count as extra rows, which is the K-FAC-expand approximation.
    """

    module: nn.Linear

    @property
    def in_features(self) -> int:
        return int(self.module.in_features)

    @property
    def out_features(self) -> int:
        return int(self.module.out_features)

    def input_rows(self, x: Tensor) -> Tensor:
        return x.reshape(-1, x.shape[-1])

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return g.reshape(-1, g.shape[-1])
