"""Kronecker factor specs: what a factor is, before any tensor exists.

A layer's curvature block is ``F_0 ⊗ F_1 ⊗ …`` over the axes of its gradient
tensor; each factor is described by a :class:`FactorSpec` (dense ``d×d``,
diagonal ``d`` or block-diagonal, the gradient axis it acts on, and whether it
is estimated from the layer's inputs or from its output gradients).
Everything that sizes, sends, stores or plans a factor reads it from the
spec: the plan, the reduction layout, checkpoints and the forecast.

A curvature method declares the *statistics* it needs
(:class:`StatisticSpec`): K-FAC's are the factors themselves
(:func:`factor_statistics`), reduced onto each factor's owner; a method may
add others — a joint per-example statistic of inputs and output gradients
(EKFAC's second moment in the eigenbasis), reduced onto the layer's
gradient workers.  Capture, reduction and the forecast read the
declaration, never a method's name.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kaisa.core.blocks import BlockLayout
from kaisa.core.options import AssignmentStrategy, LargeFactor

__all__ = [
    "FactorKind",
    "FactorSource",
    "FactorSpec",
    "ReducedTo",
    "StatisticDtype",
    "StatisticSpec",
    "factor_statistics",
    "kfac_factors",
    "limit_factors",
]


class FactorKind(str, enum.Enum):
    """How a factor is stored: a full symmetric matrix, its diagonal, or its
    diagonal blocks (a flat vector, :mod:`kaisa.core.blocks`)."""

    DENSE = "dense"
    DIAGONAL = "diagonal"
    BLOCK_DIAGONAL = "block_diagonal"


class FactorSource(str, enum.Enum):
    """What a factor (or any declared statistic) is estimated from."""

    INPUT = "input"  #: the layer's input rows (with a ones column for a bias)
    OUTPUT_GRAD = "output_grad"  #: the gradient w.r.t. the layer's output
    #: both rows of one call together, per data point (a per-example
    #: gradient's statistic); formed by the method's own code
    JOINT = "joint"
    #: the layer's (assembled) weight gradient; declared for methods such as
    #: Shampoo, not formed by capture yet (refused at construction)
    WEIGHT_GRAD = "weight_grad"


class ReducedTo(str, enum.Enum):
    """Where a statistic's sums over the data-parallel group end up."""

    OWNER = "owner"  #: the rank that owns the factor it estimates (A, G)
    #: every gradient worker of the layer, which keeps it in the method's state
    WORKERS = "workers"


class StatisticDtype(str, enum.Enum):
    """The dtype a statistic is formed, reduced and kept in."""

    FACTOR = "factor"  #: ``factor_dtype`` (the running factors')
    SECOND_ORDER = "second_order"  #: ``inv_dtype`` (the method's state, e.g. its eigenbases)


@dataclass(frozen=True)
class FactorSpec:
    """One Kronecker factor of a layer's curvature block.

    Attributes:
        name: the factor's name in reports and checkpoints (``"A"``, ``"G"``).
        kind: dense or diagonal.
        dim: its size d (a ``d×d`` matrix or a ``d`` vector).
        axis: the axis of the layer's gradient tensor it acts on.
        source: inputs or output gradients.
        blocks: the number of diagonal blocks of a block-diagonal factor (1 otherwise).
    """

    name: str
    kind: FactorKind
    dim: int
    axis: int
    source: FactorSource
    blocks: int = 1

    def __post_init__(self) -> None:
        if (self.blocks > 1) != (self.kind is FactorKind.BLOCK_DIAGONAL):
            raise ValueError(
                f"factor {self.name}: blocks must be > 1 exactly for a block-diagonal factor; "
                f"got kind={self.kind.value}, blocks={self.blocks}"
            )

    @property
    def layout(self) -> BlockLayout:
        """How the ``dim`` rows split into diagonal blocks (one block unless block-diagonal)."""
        return BlockLayout(self.dim, self.blocks)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.kind is FactorKind.DENSE:
            return (self.dim, self.dim)
        return (self.numel,)

    @property
    def numel(self) -> int:
        if self.kind is FactorKind.BLOCK_DIAGONAL:
            return self.layout.numel
        return self.dim * self.dim if self.kind is FactorKind.DENSE else self.dim

    @property
    def symmetric(self) -> bool:
        """Whether it may travel as a triangle (``symmetry_aware``; a
        block-diagonal factor travels whole)."""
        return self.kind is FactorKind.DENSE

    @property
    def label(self) -> str:
        """Its size in plans and reports: ``4096``, ``32000 diagonal`` or
        ``32000 block-diagonal 8×4000``."""
        if self.kind is FactorKind.DIAGONAL:
            return f"{self.dim} diagonal"
        if self.kind is FactorKind.BLOCK_DIAGONAL:
            return f"{self.dim} block-diagonal {self.layout.describe()}"
        return str(self.dim)

    def cost(self, strategy: AssignmentStrategy) -> float:
        """What its decomposition costs the planner: n³ (compute) or n² (memory),
        summed over the blocks of a block-diagonal factor; n if diagonal."""
        if self.kind is FactorKind.DIAGONAL:
            return float(self.dim)
        return self.layout.cost(3 if strategy is AssignmentStrategy.COMPUTE else 2)


@dataclass(frozen=True)
class StatisticSpec:
    """One statistic a curvature method needs of a layer, per factor step.

    Attributes:
        name: its name (a factor's name; for a ``WORKERS`` statistic the key
            of the method's state its running average is kept under).
        source: what it is formed from (``INPUT``/``OUTPUT_GRAD`` through the
            adapter's :meth:`~kaisa.layers.base.LayerAdapter.factor_term`;
            ``JOINT`` through the method's
            :meth:`~kaisa.methods.base.CurvatureMethod.joint_term`).
        shape: the shape of its sums (what travels and is kept).
        reduced_to: onto the owner of the factor it estimates, or onto the
            layer's gradient workers.
        dtype: the dtype rule.
        factor: the index of the layer's factor it estimates (``OWNER``
            statistics), else None.
        symmetric: may travel as a triangle.
        needs_state: formed from the method's second-order state (EKFAC's
            eigenbases): every rank forming it must hold that state, so only
            plans where every rank is a gradient worker of the layer run it.
        flop_per_row: the floating-point operations one row (data point ×
            shared position) of a call costs its term, for the forecast (a
            factor's Gram is costed from its factor spec instead).
    """

    name: str
    source: FactorSource
    shape: tuple[int, ...]
    reduced_to: ReducedTo = ReducedTo.OWNER
    dtype: StatisticDtype = StatisticDtype.FACTOR
    factor: int | None = None
    symmetric: bool = False
    needs_state: bool = False
    flop_per_row: float = 0.0

    def __post_init__(self) -> None:
        if (self.reduced_to is ReducedTo.OWNER) != (self.factor is not None):
            raise ValueError(
                f"statistic {self.name}: exactly the statistics reduced to an owner name the "
                f"factor they estimate; got reduced_to={self.reduced_to.value}, "
                f"factor={self.factor}"
            )

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def counts_rows(self) -> bool:
        """Divided by rows (data points × shared positions), as an input
        factor is; else by data points, as an output-gradient factor is."""
        return self.source is FactorSource.INPUT


def factor_statistics(factors: tuple[FactorSpec, ...]) -> tuple[StatisticSpec, ...]:
    """K-FAC's declaration: one statistic per factor, in the factors' order,
    from its source, reduced onto its owner, in ``factor_dtype``."""
    return tuple(
        StatisticSpec(
            spec.name,
            spec.source,
            spec.shape,
            ReducedTo.OWNER,
            StatisticDtype.FACTOR,
            factor=i,
            symmetric=spec.symmetric,
        )
        for i, spec in enumerate(factors)
    )


def kfac_factors(a_dim: int, g_dim: int) -> tuple[FactorSpec, ...]:
    """The two dense factors of a Linear/Conv2d-like layer: A from the inputs,
    acting on the gradient matrix's columns, and G from the output gradients,
    acting on its rows."""
    return (
        FactorSpec("A", FactorKind.DENSE, a_dim, axis=1, source=FactorSource.INPUT),
        FactorSpec("G", FactorKind.DENSE, g_dim, axis=0, source=FactorSource.OUTPUT_GRAD),
    )


def limit_factors(
    specs: tuple[FactorSpec, ...], max_dim: int | None, mode: LargeFactor
) -> tuple[FactorSpec, ...]:
    """``specs`` with every dense factor above ``max_dim`` (``max_factor_dim``)
    made diagonal or block-diagonal (``large_factor``, :mod:`kaisa.core.blocks`)."""
    if max_dim is None:
        return specs
    out = []
    for spec in specs:
        if spec.kind is FactorKind.DENSE and spec.dim > max_dim:
            if mode is LargeFactor.DIAGONAL:
                spec = dataclasses.replace(spec, kind=FactorKind.DIAGONAL)
            else:
                blocks = BlockLayout.at_most(spec.dim, max_dim).blocks
                spec = dataclasses.replace(spec, kind=FactorKind.BLOCK_DIAGONAL, blocks=blocks)
        out.append(spec)
    return tuple(out)
