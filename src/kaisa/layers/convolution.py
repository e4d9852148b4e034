"""What ``nn.Conv1d`` and ``nn.Conv2d`` share: patches, and factor terms
formed without the unfolded rows (see :mod:`kaisa.layers.patches`)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from kaisa.core.specs import FactorKind, FactorSource, FactorSpec
from kaisa.core.statistics import contribution
from kaisa.core.statistics import contribution_features_first as features_first
from kaisa.layers.base import LayerAdapter
from kaisa.layers.patches import channels_last_padded, patch_gram, patch_mean, patch_view

__all__ = ["ConvAdapter"]


class ConvAdapter(LayerAdapter):
    """A convolution with ``groups == 1`` over :attr:`spatial_dims` dimensions
    (grouped convolutions are refused at registration).

    The patches are the ones the convolution sees: the input padded with the
    module's own ``padding_mode`` (zeros, reflect, replicate, circular) and
    its own — possibly asymmetric, for ``padding='same'`` — padding amounts,
    windows of the module's kernel size, dilation and stride.  Each output
    position is one row (K-FAC-expand over positions), in the weight's
    ``(c, k…)`` order.
    """

    #: spatial dimensions after ``[N, C]``
    spatial_dims: ClassVar[int]
    module: nn.Conv1d | nn.Conv2d

    @property
    def in_features(self) -> int:
        return int(self.module.in_channels * math.prod(self.module.kernel_size))

    @property
    def out_features(self) -> int:
        return int(self.module.out_channels)

    def batch_size(self, x: Tensor) -> int:  # type: ignore[override]
        return int(x.shape[0]) if x.dim() == self.spatial_dims + 2 else 1

    def _batched(self, t: Tensor) -> Tensor:
        return t if t.dim() == self.spatial_dims + 2 else t.unsqueeze(0)

    def patches(self, x: Tensor) -> Tensor:
        """The patches of input ``x`` as a strided view ``[N, *O, *K, C]``."""
        m = self.module
        xcl = channels_last_padded(
            self._batched(x), m._reversed_padding_repeated_twice, m.padding_mode
        )
        return patch_view(xcl, m.kernel_size, m.stride, m.dilation)

    def input_rows(self, x: Tensor) -> Tensor:
        view = self.patches(x)  # [N, *O, *K, C] -> rows [N, L, C·K]
        rows = view.movedim(-1, 1 + self.spatial_dims)
        return rows.reshape(view.shape[0], -1, self.in_features)

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self._batched(g).flatten(2).transpose(1, 2)  # [N, L_out, C_out]

    def factor_term(
        self, spec: FactorSpec, tensor: Tensor, dtype: torch.dtype, scale: float | Tensor
    ) -> tuple[Tensor, float]:
        """As :meth:`LayerAdapter.factor_term`, without building the rows
        where it is avoidable: the A Gram from the patch view
        (:func:`~kaisa.layers.patches.patch_gram`), K-FAC-reduce's mean
        straight from it, the G Gram from the ``[N, C, L]`` gradient as it
        lies (:func:`~kaisa.core.statistics.contribution_features_first`)."""
        if spec.kind is not FactorKind.DENSE:
            return super().factor_term(spec, tensor, dtype, scale)
        reduce = self.reduce and self.supports_reduce
        compute = self.factor_compute_dtype
        if spec.source is FactorSource.INPUT:
            view = self.patches(tensor)
            n = int(view.shape[0])
            if not reduce:
                out = tuple(int(d) for d in view.shape[1 : 1 + self.spatial_dims])
                index = self.kept_positions(spec, math.prod(out), view.device)
                if index is not None:
                    rows = self._windows_at(view, out, index)
                    term = contribution(rows, spec.kind, dtype, scale, compute)
                    return term, float(n * index.numel())
                gram = patch_gram(view, self.spatial_dims, self.has_bias, dtype, scale, compute)
                return gram, float(n * math.prod(out))
            rows = patch_mean(view, self.spatial_dims)
            if self.has_bias:
                rows = torch.cat([rows, rows.new_ones(n, 1)], dim=1)
            return contribution(rows.unsqueeze(1), spec.kind, dtype, scale, compute), float(n)
        cols = self._batched(tensor).flatten(2)  # [N, C_out, L_out]
        n, positions = int(cols.shape[0]), int(cols.shape[2])
        if reduce:
            term = contribution(cols.sum(2).unsqueeze(1), spec.kind, dtype, scale, compute)
            return term, float(n)
        index = self.kept_positions(spec, positions, cols.device)
        if index is not None:  # G's kept positions weighted T/k (LayerAdapter.kept_rows)
            cols = cols.index_select(2, index)
            scale = scale * (positions / index.numel())
            positions = int(index.numel())
        if positions > 1 and cols.is_contiguous():
            return features_first(cols, spec.kind, dtype, scale, compute), float(n * positions)
        # channels-last (or one position): the rows are already a view
        rows = cols.transpose(1, 2)
        return contribution(rows, spec.kind, dtype, scale, compute), float(n * positions)

    def _windows_at(self, view: Tensor, out: tuple[int, ...], index: Tensor) -> Tensor:
        """Input rows ``[N, k, C·K(+1)]`` at ``index`` of the output positions,
        gathered from the patch view ``[N, *O, *K, C]`` (the whole patch
        matrix is never built), in the weight's ``(c, k…)`` order."""
        coords = torch.unravel_index(index, out)
        where: tuple[slice | Tensor, ...] = (slice(None), *coords)
        picked = view[where]  # [N, k, *K, C]
        rows = picked.movedim(-1, 2).reshape(view.shape[0], index.numel(), self.in_features)
        return self.with_bias(rows)
