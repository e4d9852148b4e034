"""``nn.Embedding``: a Linear on one-hot inputs, with a diagonal input factor.

``z = onehot(i)·W`` makes an Embedding a Linear layer whose input rows are
one-hot vectors, so ``A = E[onehot onehotᵀ]`` is diagonal: the frequency of
each token.  It is kept as a vector of ``num_embeddings`` entries — never a
vocabulary × vocabulary matrix — and built by counting, never by forming
one-hot rows; ``G`` over the embedding dimension stays dense.  The canonical
gradient matrix is ``W.grad.T`` (``[embedding_dim, num_embeddings]``).

A position holding ``padding_idx`` is a zero input row: its weight row is
frozen by PyTorch, so it adds nothing to ``A`` but, like any row, counts in
``A``'s normaliser and its output gradient counts in ``G``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kaisa.core.specs import FactorKind, FactorSource, FactorSpec
from kaisa.layers.base import LayerAdapter

__all__ = ["EmbeddingAdapter"]


class EmbeddingAdapter(LayerAdapter):
    """An ``nn.Embedding`` with dense gradients (``sparse=True`` is refused at
    registration) and any ``padding_idx``."""

    module: nn.Embedding
    supports_reduce = False  # a mean of one-hots is not one-hot: A would be dense
    broadcast_over_batch = True  # position embeddings of ids [1, T]

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name, module)
        self.has_bias = False

    @property
    def in_features(self) -> int:
        return int(self.module.num_embeddings)

    @property
    def out_features(self) -> int:
        return int(self.module.embedding_dim)

    def factor_specs(self) -> tuple[FactorSpec, ...]:
        return (
            FactorSpec("A", FactorKind.DIAGONAL, self.a_dim, axis=1, source=FactorSource.INPUT),
            FactorSpec("G", FactorKind.DENSE, self.g_dim, axis=0, source=FactorSource.OUTPUT_GRAD),
        )

    @staticmethod
    def batch_size(x: Tensor) -> int:
        # indices [N] or [N, T]: the one-hot rows add the feature dimension
        return int(x.shape[0]) if x.dim() >= 1 else 1

    @staticmethod
    def _canonical(t: Tensor, features: bool) -> Tensor:
        lead = t.shape[:-1] if features else t.shape
        if len(lead) == 0:
            return t.reshape(1, 1, -1)
        return t.reshape(lead[0], -1, *t.shape[-1:]) if features else t.reshape(lead[0], -1)

    def input_rows(self, x: Tensor) -> Tensor:
        """The one-hot rows ``[batch, shared, num_embeddings]`` (for tests and
        small vocabularies; the factor itself is counted, see :meth:`factor_term`)."""
        idx = self._canonical(x, features=False)
        rows = torch.nn.functional.one_hot(idx, self.in_features).to(torch.get_default_dtype())
        if self.module.padding_idx is not None:
            rows[..., self.module.padding_idx] = 0
        return rows

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self._canonical(g, features=True)

    def factor_term(
        self, spec: FactorSpec, tensor: Tensor, dtype: torch.dtype, scale: float | Tensor
    ) -> tuple[Tensor, float]:
        if spec.source is not FactorSource.INPUT:
            return super().factor_term(spec, tensor, dtype, scale)
        # counted by a scatter into a fixed-size vector, not bincount or a
        # mask: both have data-dependent shapes, which a compiled graph breaks on
        idx = tensor.reshape(-1)
        counts = torch.zeros(self.in_features, dtype=dtype, device=idx.device)
        counts.index_add_(0, idx, torch.ones(idx.shape, dtype=dtype, device=idx.device))
        if self.module.padding_idx is not None:
            counts[self.module.padding_idx] = 0
        if isinstance(scale, Tensor) or scale != 1.0:
            counts.mul_(scale)
        return counts, float(tensor.numel())

    def grads_to_matrix(
        self, weight_grad: Tensor, bias_grad: Tensor | None, out: Tensor | None = None
    ) -> Tensor:
        return weight_grad.t()  # a view: nothing to copy

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        return mat.t(), None
