"""``nn.Linear``: inputs with any number of leading dimensions (K-FAC-expand)."""

from __future__ import annotations

from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter

__all__ = ["LinearAdapter"]


class LinearAdapter(LayerAdapter):
    """A Linear layer; every leading index of the input is a row.

    For a sequence input ``[N, T, d]`` the ``T`` positions share the weight
    (``[batch, shared, features]`` = ``[N, T, d]``; more leading dimensions
    fold into ``shared``); K-FAC-expand counts them as extra rows.
    """

    module: nn.Linear

    @property
    def in_features(self) -> int:
        return int(self.module.in_features)

    @property
    def out_features(self) -> int:
        return int(self.module.out_features)

    @staticmethod
    def _canonical(t: Tensor) -> Tensor:
        if t.dim() == 1:  # unbatched
            return t.reshape(1, 1, -1)
        return t.reshape(t.shape[0], -1, t.shape[-1])

    def input_rows(self, x: Tensor) -> Tensor:
        return self._canonical(x)

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self._canonical(g)
