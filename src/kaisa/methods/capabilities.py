"""What a curvature method can do beyond :meth:`~kaisa.methods.base.CurvatureMethod.apply`.

A method says it by implementing a capability — a small
``typing.Protocol``, as the engines' capabilities are
(:mod:`kaisa.engines.base`) — and the step asks once, when it is wired
(``isinstance``), never per step and never by a flag on the base class:

- :class:`StackedApply`: several layers of one shape preconditioned in one
  call (:mod:`kaisa.step.batched`);
- :class:`ColumnBlockApply`: a layer's gradient read where it lies, as the
  weight's and the bias's column blocks, and ``V`` written over them
  (:mod:`kaisa.step.in_place`);
- :class:`StatefulApply`: :meth:`apply` advances tensors the method holds
  (running moments), so it must be handed the worker's own tensors — no
  cast copies (``precondition_dtype`` is refused,
  :func:`kaisa.wiring.check_method_options`), no stacked copies, and no
  deferred verdict (the moments would have moved on a step that is then
  skipped).

A method without a capability is served by :meth:`apply` alone, on every
write path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from kaisa.core.workspace import Workspace
from kaisa.methods.base import LayerView

__all__ = ["ColumnBlockApply", "StackedApply", "StatefulApply", "stacked_apply", "updates_state"]


@runtime_checkable
class StackedApply(Protocol):
    """:meth:`apply_stacked` preconditions ``L`` layers of one shape at once:
    every tensor of ``layer.state`` and ``grad`` carry a leading layer
    dimension ``[L, ...]`` (``layer.factors``: any one of them).  Holds for a
    method whose products all go through :func:`kaisa.core.kronecker.mul_axis`
    and whose :meth:`apply` writes nothing it holds."""

    def apply_stacked(self, layer: LayerView, grad: Tensor, damping: float) -> Tensor:
        """``V`` of each stacked layer, ``[L, ...]`` in ``grad``'s dtype."""
        ...


@runtime_checkable
class ColumnBlockApply(Protocol):
    """:meth:`apply_blocks` preconditions a gradient matrix held as column
    blocks (a layer's own weight and bias gradients: no matrix is
    assembled) and writes ``V`` into column blocks (no ``V`` is copied)."""

    #: :meth:`apply_blocks` forms ``⟨V, ∇⟩`` on its way, so ``∇`` need not be
    #: kept once ``V`` has overwritten it
    forms_kl_term: bool

    def writes_blocks(self, layer: LayerView, dtype: torch.dtype) -> bool:
        """Whether :meth:`apply_blocks` can precondition this layer: its first
        and last operations are matrix products, and ``layer.state`` is in
        the gradient's ``dtype`` (a cast copy in ``precondition_dtype`` goes
        through :meth:`apply`, which casts)."""
        ...

    def apply_blocks(
        self,
        layer: LayerView,
        grad: Sequence[Tensor],
        damping: float,
        work: Workspace,
        out: Sequence[Tensor],
        kl: bool,
    ) -> Tensor | None:
        """``V`` of the column blocks ``grad`` written into the column blocks
        ``out``, which may be ``grad``'s own tensors: only the first product
        reads ``grad``, and only the last writes ``out``.  Returns ``⟨V, ∇⟩``
        when ``kl`` and :attr:`forms_kl_term`, else None.  Only where
        :meth:`writes_blocks` said so."""
        ...


@runtime_checkable
class StatefulApply(Protocol):
    """:meth:`apply` updates held tensors in place (running moments of the
    gradient, advanced once per step)."""

    def advanced_keys(self) -> frozenset[str]:
        """The keys of the held tensors :meth:`apply` writes (empty: none,
        e.g. a wrapper whose base and own rule keep no moments)."""
        ...


def updates_state(method: object) -> bool:
    """Whether ``method``'s :meth:`apply` writes tensors it holds."""
    return isinstance(method, StatefulApply) and bool(method.advanced_keys())


def stacked_apply(method: object) -> StackedApply | None:
    """``method`` where its layers may be stacked: it offers
    :class:`StackedApply` and advances no state (a stacked copy of its
    moments would take the update, not the layer's own)."""
    if isinstance(method, StackedApply) and not updates_state(method):
        return method
    return None
