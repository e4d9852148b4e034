"""The layer adapter interface: one canonical shape before any K-FAC math.

An adapter knows how one module type maps its inputs and output gradients to
the canonical ``[batch, shared, features]`` tensors that :mod:`kaisa.core.statistics`
turns into Kronecker factors, which factors its curvature block has
(:meth:`LayerAdapter.factor_specs`), and how its parameters' gradients map to
the ``[d_out, d_in(+1)]`` matrix that the curvature methods precondition.
Everything else in kaisa is independent of the module type.

``shared`` holds the positions that share the weight: the ``T`` positions of
a Linear applied to ``[N, T, d]``, the ``H_out·W_out`` patches of a Conv2d.
Keeping them apart from the batch until the statistics are formed leaves room
for K-FAC-reduce and padding masks; K-FAC-expand flattens them into rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any, cast

import torch
from torch import Tensor, nn

from kaisa.config import LargeFactor
from kaisa.core.positions import PositionSampler
from kaisa.core.specs import FactorKind, FactorSource, FactorSpec, kfac_factors, limit_factors
from kaisa.core.statistics import contribution

__all__ = ["LayerAdapter", "describe_specs", "param_shape", "sole_owners", "trained"]


def trained(bias: Tensor | None) -> bool:
    """Whether ``bias`` is part of a layer's K-FAC block: a tensor that requires
    grad (a frozen bias, or a buffer, is left out of the block)."""
    return bias is not None and bool(bias.requires_grad)


def param_shape(param: Tensor) -> torch.Size:
    """A parameter's real shape, also where an engine partitions it away
    (DeepSpeed ZeRO-3 leaves ``(0,)`` outside forward and keeps ``ds_shape``)."""
    shape = getattr(param, "ds_shape", None)
    return torch.Size(shape) if shape is not None else param.shape


def sole_owners(adapters: Sequence[LayerAdapter]) -> list[bool]:
    """Per layer: whether it owns whole parameters that no other of
    ``adapters`` shares.  Only such a layer's gradients may be overwritten
    with its ``V`` and scaled by the KL clip's ``ν`` later: a row block of a
    packed projection would be scaled with its neighbours' rows, and a tied
    weight written by one layer would be read by the next."""
    seen: dict[int, int] = {}
    for adapter in adapters:
        for p in adapter.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    return [
        all(r is None for r in a.param_rows()) and all(seen[id(p)] == 1 for p in a.parameters())
        for a in adapters
    ]


class LayerAdapter(ABC):
    """Maps one registered module to the canonical K-FAC shapes.

    Attributes:
        name: the module's qualified name in the model (``model.named_modules``).
        module: the module itself.
        has_bias: whether a bias column of ones is appended to the inputs: the
            module has a bias that requires grad when the adapter is made.  A
            frozen bias is not part of the block (K-FAC over the parameters
            that are trained: the weight's block is then exactly ``G ⊗ A``
            without the ones column, and the bias never gets a gradient).
            The factor shapes are fixed from then on, so a bias frozen or
            unfrozen later is warned about (:mod:`kaisa.step.reports`).
    """

    #: whether positions may be reduced before the statistics (K-FAC-reduce)
    supports_reduce = True
    #: the engine feeds :meth:`kaisa.step.capture.calls.Capture.observe` itself (tensor
    #: parallelism gathers the shards of a call first); Capture adds no hook
    captured_by_engine = False
    #: inputs may be DTensors (tensor parallelism); elsewhere a DTensor input
    #: means the model was parallelised after the preconditioner was built
    sees_dtensors = False
    #: a call on one row of inputs may be broadcast over the batch by the model
    #: (position ids ``[1, T]``): its per-example output gradients are taken
    #: where the broadcast happens (:mod:`kaisa.step.capture.broadcast`)
    broadcast_over_batch = False

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.has_bias = trained(getattr(module, "bias", None))
        #: K-FAC-reduce instead of K-FAC-expand (set from ``kfac_approx``)
        self.reduce = False
        #: dtype of the Gram products of :meth:`factor_term` (set from
        #: ``factor_compute_dtype``; None: the factor dtype).  An adapter that
        #: overrides :meth:`factor_term` with its own product should honour it
        self.factor_compute_dtype: torch.dtype | None = None
        #: dense factors above this many rows become ``large_factor``'s kind
        #: (set from the options of the same names; None: no limit)
        self.max_factor_dim: int | None = None
        self.large_factor = LargeFactor.DIAGONAL
        #: each factor read from a fraction of a call's positions (set from
        #: ``factor_position_fraction``; None: every position).  An adapter
        #: that overrides :meth:`factor_term` should honour it
        self.positions: PositionSampler | None = None

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

    def factor_specs(self) -> tuple[FactorSpec, ...]:
        """The Kronecker factors of the layer's block: dense A (inputs, acting on
        the gradient matrix's columns) and dense G (output gradients, rows)."""
        return kfac_factors(self.a_dim, self.g_dim)

    def effective_specs(self) -> tuple[FactorSpec, ...]:
        """:meth:`factor_specs` as kept: every dense factor above
        :attr:`max_factor_dim` made diagonal or block-diagonal
        (:func:`kaisa.core.specs.limit_factors`).  What the layer's state, the
        plan, the forecast and the reports read."""
        return limit_factors(self.factor_specs(), self.max_factor_dim, self.large_factor)

    def limited_specs(self) -> tuple[FactorSpec, ...]:
        """The factors :attr:`max_factor_dim` changed, as kept (for reports)."""
        return tuple(
            kept
            for declared, kept in zip(self.factor_specs(), self.effective_specs())
            if kept != declared
        )

    # -- capture -----------------------------------------------------------
    @property
    def captured_by_module_hooks(self) -> bool:
        """Whether hooks on :attr:`module` see this layer's calls (False for
        layers a module applies functionally; see :mod:`kaisa.step.capture.attention`)."""
        return True

    @abstractmethod
    def input_rows(self, x: Tensor) -> Tensor:
        """The layer input as ``[batch, shared, in_features]`` (no bias column)."""

    @abstractmethod
    def grad_output_rows(self, g: Tensor) -> Tensor:
        """The gradient w.r.t. the layer output as ``[batch, shared, out_features]``."""

    @staticmethod
    def batch_size(x: Tensor) -> int:
        """Number of data points in a call: the input's leading dimension."""
        return int(x.shape[0]) if x.dim() > 1 else 1

    def output_tensor(self, output: Any) -> Tensor | None:
        """The tensor of a call's ``output`` whose gradient is the layer's
        output gradient (None: nothing to capture)."""
        return output if isinstance(output, Tensor) else None

    def a_rows(self, x: Tensor) -> Tensor:
        """Input rows with the bias column of ones appended when there is a bias."""
        return self.with_bias(self.input_rows(x))

    def with_bias(self, rows: Tensor) -> Tensor:
        """``rows`` with the bias column of ones appended when there is a bias."""
        if self.has_bias:
            rows = torch.cat([rows, rows.new_ones(*rows.shape[:-1], 1)], dim=-1)
        return rows

    def factor_term(
        self, spec: FactorSpec, tensor: Tensor, dtype: torch.dtype, scale: float | Tensor
    ) -> tuple[Tensor, float]:
        """One call's contribution ``scale·Σ r rᵀ`` (or its diagonal) to factor
        ``spec`` and the number of rows it holds.  An adapter whose rows would
        be wasteful to build (an Embedding's one-hot inputs) overrides this.

        Under K-FAC-reduce a data point's positions become one row first: the
        inputs' mean, the output gradients' sum.

        ``scale`` has no default: this runs inside the compiled capture's
        backward, where a default read from the function is a symbol under
        ``torch.compile(dynamic=True)`` that dynamo cannot lift there."""
        if spec.source is FactorSource.INPUT:
            # cut before the bias column is appended: only the rows read are copied
            rows, scale = self.kept_rows(spec, self.input_rows(tensor), scale)
            rows = self.with_bias(rows)
        else:
            rows, scale = self.kept_rows(spec, self.grad_output_rows(tensor), scale)
        if self.reduce and self.supports_reduce and rows.shape[1] > 1:
            if spec.source is FactorSource.INPUT:
                rows = rows.mean(1, keepdim=True)
            else:
                rows = rows.sum(1, keepdim=True)
        term = contribution(
            rows, spec.kind, dtype, scale, self.factor_compute_dtype, blocks=spec.blocks
        )
        return term, float(rows.shape[0] * rows.shape[1])

    def kept_positions(
        self, spec: FactorSpec, positions: int, device: torch.device
    ) -> Tensor | None:
        """The positions of a call that ``spec`` reads (:attr:`positions`), on
        ``device``; None: every one."""
        sampler = self.positions
        if sampler is None or positions <= 1:
            return None
        return sampler.kept(spec.name, positions, device)

    def kept_rows(
        self, spec: FactorSpec, rows: Tensor, scale: float | Tensor
    ) -> tuple[Tensor, float | Tensor]:
        """``[batch, shared, features]`` rows at the positions ``spec`` reads,
        and the scale of their term: G's weighted ``T/k``, so that its sum
        over positions stays unbiased (A counts the rows it read)."""
        positions = int(rows.shape[1])
        index = self.kept_positions(spec, positions, rows.device)
        if index is None:
            return rows, scale
        rows = rows.index_select(1, index)
        if spec.source is FactorSource.OUTPUT_GRAD:
            scale = scale * (positions / index.numel())
        return rows, scale

    # -- parameters --------------------------------------------------------
    # Read on every step, several times per layer: straight from the module's
    # parameter table where it is there (``nn.Module.__getattr__`` is a Python
    # function), through the attribute otherwise.
    @property
    def weight(self) -> nn.Parameter:
        found = self.module._parameters.get("weight")
        return cast(nn.Parameter, self.module.weight if found is None else found)

    @property
    def bias(self) -> nn.Parameter | None:
        table = self.module._parameters
        if "bias" in table:
            return table["bias"]
        return cast("nn.Parameter | None", getattr(self.module, "bias", None))

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def trainable(self) -> bool:
        """Whether the weight requires grad now (it may be frozen and unfrozen)."""
        return bool(self.weight.requires_grad)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients this adapter preconditions."""
        bias = self.bias
        return [self.weight, bias] if self.has_bias and bias is not None else [self.weight]

    def param_rows(self) -> list[slice | None]:
        """The rows (first dimension) of each of :meth:`parameters` that this
        layer owns: ``None`` for all of it; a slice where several layers share
        one tensor (the packed q/k/v projection of ``nn.MultiheadAttention``)."""
        return [None] * len(self.parameters())

    def param_names(self) -> list[str]:
        """How :meth:`describe` and reports name the preconditioned parameters."""
        return [f"{self.name}.weight"] + ([f"{self.name}.bias"] if self.has_bias else [])

    def grads_of(self, grads: list[Tensor | None]) -> list[Tensor | None]:
        """This layer's rows of the full parameter gradients ``grads``."""
        return [g if g is None or r is None else g[r] for g, r in zip(grads, self.param_rows())]

    def matrix_of(self, full: Sequence[Tensor | None], out: Tensor | None = None) -> Tensor | None:
        """The canonical gradient from the full gradients of :meth:`parameters`
        (None without a weight gradient; a missing bias gradient is zero);
        ``out``, of :attr:`matrix_shape`, receives it where it must be copied."""
        grads = self.grads_of(list(full))
        weight = grads[0]
        if weight is None:
            return None
        bias = None
        if self.has_bias:
            bias = grads[1] if grads[1] is not None else weight.new_zeros(self.out_features)
        return self.grads_to_matrix(weight, bias, out)

    def grads_to_matrix(
        self, weight_grad: Tensor, bias_grad: Tensor | None, out: Tensor | None = None
    ) -> Tensor:
        """``[d_out, d_in(+1)]`` gradient matrix; bias as the last column (a
        copy, into ``out`` when given; without a bias, a view)."""
        mat = weight_grad.reshape(weight_grad.shape[0], -1)
        if bias_grad is not None:
            mat = torch.cat([mat, bias_grad.reshape(-1, 1)], dim=1, out=out)
        return mat

    def grad_blocks(self, full: Sequence[Tensor | None]) -> list[Tensor] | None:
        """The gradient matrix's column blocks as views of the parameters' own
        gradients ``full`` (``∇W`` as ``[d_out, ·]``, then ``∇b`` as one
        column), for products that read and write them where they lie
        (:func:`kaisa.core.kronecker.mul_axis_from`).  None where the matrix is
        not that concatenation: a missing or non-contiguous gradient, or an
        adapter with a layout of its own (rows of a shared tensor, a
        transposed weight)."""
        shape = self._plain_matrix_shape
        if shape is None or len(full) != 1 + self.has_bias:
            return None
        blocks = []
        for g in full:
            if g is None or not g.is_contiguous() or g.dtype != full[0].dtype:  # type: ignore[union-attr]
                return None
            blocks.append(g.view(shape[0], -1))
        return blocks if sum(int(b.shape[1]) for b in blocks) == shape[1] else None

    @cached_property
    def _plain_matrix_shape(self) -> tuple[int, int] | None:
        """:attr:`matrix_shape` where the matrix is the plain concatenation of
        whole parameters' gradients (:meth:`grad_blocks`), else None; fixed
        for the adapter's life, so asked once rather than every step."""
        cls = type(self)
        own_layout = (
            cls.grads_to_matrix is not LayerAdapter.grads_to_matrix
            or cls.matrix_to_grads is not LayerAdapter.matrix_to_grads
            or cls.matrix_of is not LayerAdapter.matrix_of
            or any(r is not None for r in self.param_rows())
        )
        shape = tuple(self.matrix_shape)
        if own_layout or len(shape) != 2:
            return None
        return int(shape[0]), int(shape[1])

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        """Inverse of :meth:`grads_to_matrix`, shaped like the parameters."""
        weight, bias = self.weight, self.bias
        if self.has_bias and bias is not None:
            return mat[:, :-1].reshape(param_shape(weight)), mat[:, -1].reshape(param_shape(bias))
        return mat.reshape(param_shape(weight)), None

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """Shape of the gradient tensor the factors act on (one axis per factor),
        known without a gradient: what a rank that only receives it allocates."""
        return tuple(s.dim for s in sorted(self.factor_specs(), key=lambda s: s.axis))

    def describe(self) -> str:
        return f"{type(self.module).__name__}({describe_specs(self.effective_specs())})"


def describe_specs(specs: Sequence[FactorSpec]) -> str:
    """``A: 129×129, G: 32000 diagonal`` or ``G: block-diagonal 8×4000``."""
    parts = []
    for s in specs:
        if s.kind is FactorKind.DIAGONAL:
            parts.append(f"{s.name}: {s.dim} diagonal")
        elif s.kind is FactorKind.BLOCK_DIAGONAL:
            parts.append(f"{s.name}: block-diagonal {s.layout.describe()}")
        else:
            parts.append(f"{s.name}: {s.dim}×{s.dim}")
    return ", ".join(parts)
