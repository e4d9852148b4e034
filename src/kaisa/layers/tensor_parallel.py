"""Adapters for linear layers sharded over a tensor-parallel group: ``nn.Linear``
sharded by ``parallelize_module`` and Megatron-core's ``ColumnParallelLinear``
/ ``RowParallelLinear`` (plain tensors; see :mod:`kaisa.layers.megatron`).
Both are described by a :class:`Sharding`, so the adapters below and the
engine do not depend on which framework sharded the layer.

``ColwiseParallel`` shards a Linear's weight by output rows (``Shard(0)``,
the bias with it): its input is replicated and its output sharded on the
last dimension.  ``RowwiseParallel`` shards the weight by input columns
(``Shard(1)``) and replicates the bias: its input is sharded on the last
dimension and its output replicated (summed over the group).  Shards follow
``torch.chunk``: rank ``t`` of ``T`` holds ``[t·c, min((t+1)·c, n))`` with
``c = ⌈n/T⌉``, so late ranks may hold fewer (or no) rows.

What a hook sees depends on when it was registered (measured, torch 2.13):
forward hooks always see the DTensor input that parallelize_module's
pre-hook made (Replicate or Shard(-1)); a hook registered after
parallelising sees the local output and local output gradient, one
registered before sees DTensors (Shard(-1) or Partial output, Shard(-1) or
Replicate gradient).  :func:`local` turns either into the local tensor, so
the adapters below work in both cases.

Two ways to precondition such a layer (``tensor_parallel=``):

* :class:`ExactShardedAdapter` (``'exact'``): the factors of the *unsharded*
  layer.  Its statistics are fed by the engine with the shards of a call
  gathered onto the layer's primary tensor-parallel rank, so it has the full
  sizes and the preconditioning of the dense layer.
* :class:`ShardBlockAdapter` (``'block'``): the factor block of this rank's
  shard alone — a colwise layer's G restricted to its output rows, a rowwise
  layer's A restricted to its input columns — plus, for a rowwise layer's
  replicated bias, :class:`ReplicatedBiasAdapter`: the bias's own block,
  whose A is ``E[1·1] = 1``, so its update is ``(G + γI)⁻¹ ∇b``, computed
  identically on every tensor-parallel rank.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter, describe_specs
from kaisa.layers.linear import LinearAdapter

__all__ = [
    "ExactShardedAdapter",
    "ReplicatedBiasAdapter",
    "ShardBlockAdapter",
    "Sharding",
    "Style",
    "local",
    "shard_range",
]


class Style(str, enum.Enum):
    """How a Linear's weight is sharded over the tensor-parallel group."""

    COLWISE = "colwise"  #: Shard(0): output rows (and the bias)
    ROWWISE = "rowwise"  #: Shard(1): input columns; the bias replicated


@dataclass(frozen=True)
class Sharding:
    """How one linear layer is sharded: the style and the *unsharded* sizes
    (the local weight's shape is a shard's; only the framework knows the rest)."""

    style: Style
    in_features: int
    out_features: int


def local(t: Any) -> Any:
    """The local tensor of a DTensor; anything else unchanged (duck-typed, so
    this module never imports ``torch.distributed``)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def shard_range(n: int, size: int, rank: int) -> slice:
    """Rank ``rank``'s part of ``n`` rows sharded over ``size`` ranks, as ``torch.chunk``."""
    chunk = -(-n // size)
    return slice(min(rank * chunk, n), min((rank + 1) * chunk, n))


class ExactShardedAdapter(LinearAdapter):
    """A sharded Linear preconditioned as the unsharded layer, on its primary rank.

    Sizes, factors and the gradient matrix are the full layer's; the engine
    gathers a call's input (rowwise) or output gradient (colwise) shards onto
    :attr:`primary` before :meth:`kaisa.step.capture.calls.Capture.observe`, and the
    gradient's shards before preconditioning, then scatters the result back.
    """

    captured_by_engine = True
    sees_dtensors = True

    def __init__(self, base: LinearAdapter, sharding: Sharding, primary: int) -> None:
        super().__init__(base.name, base.module)
        self.call = base.call
        self.style = sharding.style
        self.sharding = sharding
        self.primary = primary  #: the tensor-parallel rank that does this layer's K-FAC work

    @property
    def in_features(self) -> int:
        return self.sharding.in_features

    @property
    def out_features(self) -> int:
        return self.sharding.out_features

    def input_rows(self, x: Tensor) -> Tensor:
        return self._canonical(local(x))

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self._canonical(local(g))

    def describe(self) -> str:
        return f"{super().describe()} {self.style.value}, exact on tp rank {self.primary}"


class ShardBlockAdapter(LinearAdapter):
    """This rank's shard of a sharded Linear as a layer of its own (block mode).

    Colwise: inputs are the full (replicated) input, outputs this rank's
    rows, the bias column included.  Rowwise: inputs are this rank's input
    columns, outputs all of them, no bias column (the replicated bias is
    :class:`ReplicatedBiasAdapter`'s).  Gradients are the local shards.
    """

    sees_dtensors = True

    def __init__(self, base: LinearAdapter, sharding: Sharding, tp_size: int, tp_rank: int):
        super().__init__(base.name, base.module)
        self.call = base.call
        self.style = style = sharding.style
        full_in, full_out = sharding.in_features, sharding.out_features
        if style is Style.COLWISE:
            rows = shard_range(full_out, tp_size, tp_rank)
            self._in, self._out = full_in, rows.stop - rows.start
        else:
            cols = shard_range(full_in, tp_size, tp_rank)
            self._in, self._out = cols.stop - cols.start, full_out
            self.has_bias = False
        self.tp_rank = tp_rank

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def out_features(self) -> int:
        return self._out

    @property
    def bias(self) -> nn.Parameter | None:
        return super().bias if self.style is Style.COLWISE else None

    def input_rows(self, x: Tensor) -> Tensor:
        return self._canonical(local(x))

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self._canonical(local(g))

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        """Local shard shapes (the parameters' own shapes are the global ones)."""
        if self.has_bias:
            return mat[:, :-1], mat[:, -1]
        return mat, None

    def param_names(self) -> list[str]:
        names = [f"{self.name}.weight"] + ([f"{self.name}.bias"] if self.has_bias else [])
        return [f"{n} (tp shard {self.tp_rank})" for n in names]

    def describe(self) -> str:
        return f"{super().describe()} {self.style.value} block of tp rank {self.tp_rank}"


class ReplicatedBiasAdapter(LayerAdapter):
    """The replicated bias of a rowwise-sharded Linear as its own block (block mode).

    In the unsharded layer the bias is the last column of the gradient
    matrix and its input is a constant 1.  Block mode splits A block-diagonally
    along the shards *and* the bias column, whose block is ``E[1·1] = 1``:
    the bias's block is ``1 ⊗ G`` with the layer's (replicated) G, so its
    update is ``(G + γI)⁻¹ ∇b``.  G and ``∇b`` are the same on every
    tensor-parallel rank, so every rank computes the same update and the bias
    stays replicated; the KL clip counts it once.
    """

    sees_dtensors = True

    def __init__(self, base: LinearAdapter, sharding: Sharding) -> None:
        super().__init__(f"{base.name}.bias", base.module)
        self.layer_name = base.name
        self.call = base.call
        self._out = sharding.out_features
        self.has_bias = True  # the constant-1 input column

    @property
    def in_features(self) -> int:
        return 0

    @property
    def out_features(self) -> int:
        return self._out

    def batch_size(self, x: Tensor) -> int:  # type: ignore[override]
        return self.call.batch_size(x)

    def output_tensor(self, output: Any) -> Tensor | None:
        return self.call.output(output)

    @property
    def weight(self) -> nn.Parameter:
        bias = self.module.bias
        assert isinstance(bias, nn.Parameter)
        return bias

    @property
    def bias(self) -> nn.Parameter | None:
        return None

    def parameters(self) -> list[nn.Parameter]:
        return [self.weight]

    def input_rows(self, x: Tensor) -> Tensor:
        return self.call.rows(local(x))[..., :0]

    def grad_output_rows(self, g: Tensor) -> Tensor:
        return self.call.rows(local(g))

    def matrix_of(self, full: Sequence[Tensor | None], out: Tensor | None = None) -> Tensor | None:
        grad = full[0]
        return None if grad is None else grad.reshape(-1, 1)

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        return mat.reshape(-1), None

    def param_names(self) -> list[str]:
        return [f"{self.layer_name}.bias"]

    def describe(self) -> str:
        return f"replicated bias of a rowwise Linear ({describe_specs(self.effective_specs())})"
