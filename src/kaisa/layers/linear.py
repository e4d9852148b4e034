"""``nn.Linear``: inputs with any number of leading dimensions (K-FAC-expand)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from kaisa.core.specs import FactorKind, FactorSource, FactorSpec
from kaisa.layers.base import LayerAdapter, describe_specs

__all__ = ["LinearAdapter", "LinearCall", "TiedHeadAdapter"]


@dataclass(frozen=True)
class LinearCall:
    """How a linear-like module is called: which input dimension is the batch
    and where its output is.  ``nn.Linear`` takes ``[batch, ..., d]`` and
    returns a tensor; Megatron-core's parallel linears take ``[sequence,
    batch, d]`` and return ``(output, bias)``.  The batch dimension matters
    for the gradient multiplier (``loss_average``) and for K-FAC-reduce."""

    sequence_first: bool = False  #: a 3-D input is ``[sequence, batch, d]``
    returns_bias: bool = False  #: the module returns ``(output, bias or None)``

    def rows(self, t: Tensor) -> Tensor:
        """``t`` as ``[batch, shared, features]``."""
        if t.dim() == 1:  # unbatched
            return t.reshape(1, 1, -1)
        if self.sequence_first and t.dim() == 3:
            t = t.transpose(0, 1)
        return t.reshape(t.shape[0], -1, t.shape[-1])

    def batch_size(self, x: Tensor) -> int:
        if self.sequence_first and x.dim() == 3:
            return int(x.shape[1])
        return int(x.shape[0]) if x.dim() > 1 else 1

    def output(self, output: Any) -> Tensor | None:
        """The tensor whose gradient is the layer's output gradient.  With
        ``returns_bias`` it is the first element: when the module returns its
        bias instead of adding it (Megatron's ``skip_bias_add``), the caller
        adds it, so that element's gradient is still the pre-activation's."""
        if self.returns_bias and isinstance(output, tuple) and output:
            output = output[0]
        return output if isinstance(output, Tensor) else None


class LinearAdapter(LayerAdapter):
    """A Linear layer; every leading index of the input is a row.

    For a sequence input ``[N, T, d]`` the ``T`` positions share the weight
    (``[batch, shared, features]`` = ``[N, T, d]``; more leading dimensions
    fold into ``shared``); K-FAC-expand counts them as extra rows.
    """

    module: nn.Linear
    call = LinearCall()

    @property
    def in_features(self) -> int:
        return int(self.module.in_features)

    @property
    def out_features(self) -> int:
        return int(self.module.out_features)

    def _canonical(self, t: Tensor) -> Tensor:
        return self.call.rows(t)

    def batch_size(self, x: Tensor) -> int:  # type: ignore[override]
        return self.call.batch_size(x)

    def output_tensor(self, output: Any) -> Tensor | None:
        return self.call.output(output)

    def input_rows(self, x: Tensor) -> Tensor:
        return self._canonical(x)

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self._canonical(g)


class TiedHeadAdapter(LinearAdapter):
    """An output head whose weight is an Embedding's (GPT-2's ``lm_head``).

    The tied weight's gradient is the sum of the head's and the embedding's;
    its Fisher block is the sum of two Kronecker products, which no single
    Kronecker product equals.  kaisa preconditions the summed gradient with
    the *head's* factors and leaves out the embedding's curvature term (it
    touches only the rows of the tokens in the batch, while the head's spans
    the whole vocabulary): ``A`` over the hidden features (dense), and ``G``
    over the vocabulary kept **diagonal** — ``E[ĝ_v²]``, O(vocabulary) where a
    dense ``G`` would be vocabulary².
    """

    def __init__(self, name: str, module: nn.Module, embedding: str) -> None:
        super().__init__(name, module)
        self.embedding = embedding

    def factor_specs(self) -> tuple[FactorSpec, ...]:
        return (
            FactorSpec("A", FactorKind.DENSE, self.a_dim, axis=1, source=FactorSource.INPUT),
            FactorSpec(
                "G", FactorKind.DIAGONAL, self.g_dim, axis=0, source=FactorSource.OUTPUT_GRAD
            ),
        )

    def describe(self) -> str:
        return (
            f"Linear({describe_specs(self.effective_specs())}) tied to "
            f"{self.embedding}.weight: the head's factors, the embedding's curvature term left out"
        )
