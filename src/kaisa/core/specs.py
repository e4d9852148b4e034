"""Kronecker factor specs: what a factor is, before any tensor exists.

A layer's curvature block is ``F_0 ⊗ F_1 ⊗ …`` over the axes of its gradient
tensor; each factor is described by a :class:`FactorSpec` (dense ``d×d``,
diagonal ``d`` or block-diagonal, the gradient axis it acts on, and whether it
is estimated from the layer's inputs or from its output gradients).
Everything that sizes, sends, stores or plans a factor reads it from the
spec: the plan, the reduction layout, checkpoints and the forecast.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kaisa.config import AssignmentStrategy, LargeFactor
from kaisa.core.blocks import BlockLayout

__all__ = ["FactorKind", "FactorSource", "FactorSpec", "kfac_factors", "limit_factors"]


class FactorKind(str, enum.Enum):
    """How a factor is stored: a full symmetric matrix, its diagonal, or its
    diagonal blocks (a flat vector, :mod:`kaisa.core.blocks`)."""

    DENSE = "dense"
    DIAGONAL = "diagonal"
    BLOCK_DIAGONAL = "block_diagonal"


class FactorSource(str, enum.Enum):
    """What a factor is estimated from."""

    INPUT = "input"  #: the layer's input rows (with a ones column for a bias)
    OUTPUT_GRAD = "output_grad"  #: the gradient w.r.t. the layer's output


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
