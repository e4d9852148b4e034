"""The curvature-method interface: what a method holds, computes and applies.

A curvature method turns a layer's running Kronecker factors into
second-order tensors (eigenbases, inverses, …) and applies them to the
layer's gradient.  It *declares* those tensors (:class:`HeldTensor`: name,
shape, symmetric) and which owner produces which of them
(:class:`Transfer`), so communication, memory accounting, checkpoints and the
damping-only fallback iterate over the declaration and never name a tensor.
The tensor names are private to each method's module.

A method also declares the *statistics* it needs of a layer
(:meth:`CurvatureMethod.statistics`, :class:`kaisa.core.specs.StatisticSpec`):
K-FAC's are its factors, reduced onto their owners; a method may add a joint
per-example statistic, formed by its own :meth:`CurvatureMethod.joint_term`
(called generically by capture) and reduced onto the layer's gradient
workers.  And it declares what it costs (:attr:`CurvatureMethod.kernel`,
:attr:`CurvatureMethod.products_per_factor`), which the forecast reads.

Methods never call ``torch.distributed`` and know nothing of ranks: the step
pipeline (:mod:`kaisa.step.pipeline`) decides who decomposes and who receives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from kaisa.core.blocks import BlockLayout
from kaisa.core.kronecker import mul_axis
from kaisa.core.specs import FactorKind, FactorSpec, StatisticSpec, factor_statistics
from kaisa.core.workspace import Workspace

__all__ = ["CurvatureMethod", "HeldTensor", "LayerView", "Operands", "Transfer"]

Factors = Sequence[FactorSpec]

_T = TypeVar("_T")


class IdentityMemo(Generic[_T]):
    """What a function of a layer's factor specs returns, remembered by the
    specs' identity: a layer's ``factors`` is one long-lived tuple, and
    hashing its frozen dataclasses (enum fields included) on every step
    costs more than the keys it would look up.  The key object is kept, so
    its ``id`` cannot be reused while remembered; past :attr:`limit` entries
    (specs built per call by a caller, many models in one process) it starts
    afresh rather than keep every tuple it ever saw."""

    limit = 4096

    def __init__(self, build: Callable[..., _T]) -> None:
        self._build = build
        self._seen: dict[tuple[int, bool], tuple[object, _T]] = {}

    def __call__(self, factors: Factors, flag: bool = False) -> _T:
        if torch.compiler.is_compiling():  # traced once per compilation: built there
            return self._build(factors, flag)
        found = self._seen.get((id(factors), flag))
        if found is None or found[0] is not factors:
            if len(self._seen) >= self.limit:
                self._seen.clear()
            found = self._seen[id(factors), flag] = (factors, self._build(factors, flag))
        return found[1]


def block_layout(spec: FactorSpec) -> BlockLayout | None:
    """The layout of a block-diagonal factor's matrices (None for other kinds)."""
    return spec.layout if spec.kind is FactorKind.BLOCK_DIAGONAL else None


def mul_factor(
    v: Tensor, spec: FactorSpec, m: Tensor, out: Tensor | None, transpose: bool = False
) -> Tensor:
    """:func:`kaisa.core.kronecker.mul_axis` of a dense or block-diagonal
    factor's matrix ``m`` (``mᵀ`` with ``transpose``) along the factor's axis;
    a block-diagonal one ignores ``out``."""
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        return spec.layout.mul(v, m, spec.axis, transpose)
    return mul_axis(v, m.transpose(-2, -1) if transpose else m, spec.axis, out)


@dataclass(frozen=True)
class HeldTensor:
    """One second-order tensor a gradient worker holds."""

    key: str
    shape: tuple[int, ...]
    symmetric: bool = False  #: may travel as a triangle
    #: the blocks of a block-diagonal matrix stored flat (:mod:`kaisa.core.blocks`)
    layout: BlockLayout | None = None

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class Transfer:
    """The factors one owner decomposes together and the tensors it sends."""

    factors: tuple[int, ...]
    tensors: tuple[HeldTensor, ...]


class LayerView(Protocol):
    """One layer as a method sees it: what it reads and writes of the layer.

    ``factors``: the layer's factor specs, one long-lived tuple per layer
    (:class:`IdentityMemo` keys on it).  ``state``: the second-order tensors
    by the keys the method declared (:meth:`CurvatureMethod.held`), which
    :meth:`~CurvatureMethod.receive`, :meth:`~CurvatureMethod.complete` and
    :meth:`~CurvatureMethod.fill_missing` write.  ``running[i]``: factor
    ``i``'s running average where this rank owns it and None elsewhere (read
    by :meth:`~CurvatureMethod.exchange` and :meth:`~CurvatureMethod.decompose`).

    A layer's own state (:class:`kaisa.layers.state.KFACLayer`) is one;
    :class:`Operands` is one for what :meth:`~CurvatureMethod.apply` is
    handed instead of the state itself.  One argument instead of the same
    positional ones in every method's signature: a method reads what it
    needs, and what a layer offers grows here, not in each override."""

    @property
    def factors(self) -> Factors: ...

    @property
    def state(self) -> dict[str, Tensor]: ...

    @property
    def running(self) -> Sequence[Tensor | None]: ...


@dataclass(frozen=True)
class Operands:
    """A :class:`LayerView` of tensors that are not the layer's own state:
    their cast copies in ``precondition_dtype`` (:mod:`kaisa.core.precision`)
    or several layers' stacked along a leading dimension
    (:class:`kaisa.methods.capabilities.StackedApply`); no running factors."""

    factors: Factors
    state: dict[str, Tensor]
    running: Sequence[Tensor | None] = ()


class CurvatureMethod(ABC):
    """Eigen, inverse, EKFAC, EKFAC-Adam (and a user's own) behind one interface.

    Every call receives the layer as a :class:`LayerView` (or its factor
    specs alone, for what is declared of the specs).  What a method can do
    beyond :meth:`apply` it says by implementing a capability
    (:mod:`kaisa.methods.capabilities`), checked once at wiring.
    """

    name: str
    #: the kernel a dense factor's decomposition runs, in the cost model's
    #: terms (:meth:`kaisa.planner.costs.CostModel.decompose`): ``"eigh"`` or ``"inverse"``
    kernel: str = "eigh"
    #: products of the gradient with each dense factor's matrix per step
    #: (into an eigenbasis and back: 2; with an inverse: 1), for the forecast
    products_per_factor: int = 2

    @classmethod
    def from_options(cls, *, outer_product: bool) -> CurvatureMethod:
        """The method as ``compute_method`` selects it, with the options that
        concern it (:func:`kaisa.methods.method_for`)."""
        return cls()

    def statistics(self, factors: Factors) -> tuple[StatisticSpec, ...]:
        """What the method needs of a layer per factor step: the factors
        themselves (K-FAC's A and G, reduced onto their owners) first, in
        their order, then anything of its own."""
        return factor_statistics(tuple(factors))

    def joint_term(
        self,
        statistic: StatisticSpec,
        layer: LayerView,
        a_rows: Tensor,
        g_rows: Tensor,
        scale: float | Tensor,
        dtype: torch.dtype,
    ) -> Tensor | None:
        """One call's unnormalised contribution to a ``JOINT`` statistic from
        its ``[batch, shared, ·]`` input rows (with the bias column) and
        output-gradient rows, ``scale`` being ``m²`` of the loss multiplier
        (:mod:`kaisa.core.statistics`); its count is the call's data points.
        None: no term this call (e.g. no eigenbasis yet)."""
        raise NotImplementedError(f"{type(self).__name__} declares no joint statistic")

    @abstractmethod
    def transfers(self, factors: Factors, colocated: bool) -> tuple[Transfer, ...]:
        """Who produces what: one entry per owner (all factors when colocated)."""

    @abstractmethod
    def held(self, factors: Factors, colocated: bool) -> tuple[HeldTensor, ...]:
        """Everything a gradient worker holds once an update is complete."""

    def exchange(self, layer: LayerView) -> Tensor | None:
        """A small float64 vector the owners contribute to and that is summed
        over the data-parallel group before :meth:`decompose` (None: no need)."""
        return None

    @abstractmethod
    def decompose(
        self,
        layer: LayerView,
        which: tuple[int, ...],
        damping: float,
        dtype: torch.dtype,
        exchanged: Tensor | None,
    ) -> dict[str, Tensor]:
        """The tensors of ``transfers`` for the factors ``which`` (of
        ``layer.running``), in ``dtype``.

        Raises :class:`kaisa.core.decompose.DecompositionError` on a numerical
        failure; the caller then keeps the previous tensors.
        """

    def receive(self, layer: LayerView, new: Mapping[str, Tensor]) -> None:
        """Take tensors a decomposition produced or a broadcast delivered into
        ``layer.state`` (default: ``update(new)``).

        Called on every rank that keeps them, once per :class:`Transfer`,
        before :meth:`complete`, while ``state`` still holds the previous
        tensors: a method whose state is expressed in the old tensors' terms
        (running moments in an eigenbasis) carries it over here."""
        layer.state.update(new)

    def complete(self, layer: LayerView, damping: float, colocated: bool) -> None:
        """Derive what a worker holds from what it received (default: nothing)."""
        return None

    @abstractmethod
    def fallback(self, tensor: HeldTensor, n_factors: int, damping: float, like: Tensor) -> Tensor:
        """A damping-only stand-in for ``tensor`` (dtype and device of ``like``).

        Together the stand-ins make the method fall back to a step that
        needs no curvature — ``∇/γ`` for the K-FAC methods, which the KL
        clip bounds; plain Adam for ``ekfac_adam``, whose basis is then the
        identity.  Used when a factor could never be decomposed, so that
        every rank still takes part in the same collectives.
        """

    def fill_missing(
        self, layer: LayerView, tensors: Sequence[HeldTensor], damping: float, like: Tensor
    ) -> None:
        """Damping-only stand-ins (:meth:`fallback`) for whatever of
        ``tensors`` ``layer.state`` lacks: a layer never decomposed (every
        batch non-finite so far, or a checkpoint without second-order state)
        still preconditions, broadcasts and saves like the others."""
        state, n_factors = layer.state, len(layer.factors)
        for tensor in tensors:
            if tensor.key not in state:
                state[tensor.key] = self.fallback(tensor, n_factors, damping, like)

    @abstractmethod
    def apply(
        self, layer: LayerView, grad: Tensor, damping: float, work: Workspace | None = None
    ) -> Tensor:
        """The preconditioned gradient, in the gradient's dtype.

        The products run in the dtype of ``layer.state``'s tensors: a worker
        hands its state itself, or its cached copies in ``precondition_dtype``
        (:mod:`kaisa.core.precision`), so a method never casts its own operands.
        With ``work`` the products are written into its buffers
        (:class:`kaisa.core.workspace.Alternating`) and the result may be a view
        of one, valid until the next layer's; ``grad`` is never written.
        """

    @cached_property
    def _held_keys(self) -> IdentityMemo[tuple[str, ...]]:
        """The keys of :meth:`held`, once per layer (asked every step)."""
        return IdentityMemo(lambda f, c: tuple(t.key for t in self.held(f, c)))

    def ready(self, layer: LayerView, colocated: bool) -> bool:
        """Whether ``layer.state`` holds every tensor :meth:`held` declares."""
        state = layer.state
        return all(key in state for key in self._held_keys(layer.factors, colocated))
