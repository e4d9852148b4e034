"""Per-layer K-FAC state: statistics, running factors and second-order tensors.

A :class:`KFACLayer` owns nothing but tensors and the pure math that maps
them into each other; *which* of these steps a rank performs for a layer is
decided by the work plan (:mod:`kaisa.plan`) and carried out by the
orchestrator (:mod:`kaisa.preconditioner`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kaisa.config import ComputeMethod
from kaisa.decompose import (
    DecompositionError,
    damped_inverse,
    eigen_outer_inverse,
    pi_split,
    symmetric_eigh,
)
from kaisa.factors import FactorStatistics
from kaisa.layers.base import LayerAdapter
from kaisa.precondition import precondition_eigen, precondition_inverse

__all__ = ["KFACLayer", "PendingCapture"]


@dataclass
class PendingCapture:
    """Raw captures kept until ``step()`` when ``update_factors_in_hook=False``."""

    inputs: list[Tensor] = field(default_factory=list)
    grads: list[tuple[Tensor, int, float | Tensor, int]] = field(default_factory=list)


class KFACLayer:
    """The K-FAC state of one registered module.

    Second-order tensors live in :attr:`second_order` under fixed keys so that
    communication and memory accounting can treat them uniformly:

    * eigen: ``qa``, ``qg`` and either ``inv_outer`` = 1/(λ_G λ_Aᵀ + γ) or
      ``eig_a``, ``eig_g``;
    * inverse: ``a_inv``, ``g_inv``.
    """

    def __init__(
        self, adapter: LayerAdapter, factor_dtype: torch.dtype, inv_dtype: torch.dtype
    ) -> None:
        self.adapter = adapter
        self.name = adapter.name
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.stats = FactorStatistics(adapter.a_dim, adapter.g_dim)
        self.pending = PendingCapture()
        self.second_order: dict[str, Tensor] = {}
        self.failed_decompositions = 0
        self.decompositions = 0  #: factors this rank has decomposed (A and G count apart)
        #: statistics were captured at some factor update (or loaded).  The same
        #: on every rank; a layer never captured keeps its raw gradient.
        self.captured = False

    def __repr__(self) -> str:
        return f"KFACLayer({self.name!r}, {self.adapter.describe()})"

    # -- decomposition -----------------------------------------------------
    def eigen_a(self) -> dict[str, Tensor]:
        """Eigendecomposition of the running A: ``{'qa', 'eig_a'}``."""
        assert self.stats.A is not None
        q, lam = symmetric_eigh(self.stats.A, self.inv_dtype)
        return {"qa": q, "eig_a": lam}

    def eigen_g(self) -> dict[str, Tensor]:
        """Eigendecomposition of the running G: ``{'qg', 'eig_g'}``."""
        assert self.stats.G is not None
        q, lam = symmetric_eigh(self.stats.G, self.inv_dtype)
        return {"qg": q, "eig_g": lam}

    def inverse_a(self, pi: Tensor, damping: float) -> dict[str, Tensor]:
        assert self.stats.A is not None
        return {"a_inv": damped_inverse(self.stats.A, pi * damping**0.5, self.inv_dtype)}

    def inverse_g(self, pi: Tensor, damping: float) -> dict[str, Tensor]:
        assert self.stats.G is not None
        return {"g_inv": damped_inverse(self.stats.G, damping**0.5 / pi, self.inv_dtype)}

    def traces(self) -> tuple[Tensor, Tensor]:
        assert self.stats.A is not None and self.stats.G is not None
        return torch.trace(self.stats.A), torch.trace(self.stats.G)

    def decompose(
        self,
        method: ComputeMethod,
        damping: float,
        outer_product: bool,
        *,
        do_a: bool = True,
        do_g: bool = True,
        pi: Tensor | None = None,
    ) -> bool:
        """Recompute this rank's share of the second-order tensors.

        On failure (non-finite factor, no convergence) the previous tensors
        are kept and ``False`` is returned: a numerical failure never replaces
        a valid decomposition with garbage.
        """
        self.decompositions += int(do_a) + int(do_g)
        try:
            new: dict[str, Tensor] = {}
            if method is ComputeMethod.EIGEN:
                if do_a:
                    new.update(self.eigen_a())
                if do_g:
                    new.update(self.eigen_g())
                if outer_product and do_a and do_g:
                    new["inv_outer"] = eigen_outer_inverse(
                        new.pop("eig_g"), new.pop("eig_a"), damping
                    )
            else:
                if pi is None:
                    trace_a, trace_g = self.traces()
                    pi = pi_split(trace_a, self.adapter.a_dim, trace_g, self.adapter.g_dim)
                if do_a:
                    new.update(self.inverse_a(pi, damping))
                if do_g:
                    new.update(self.inverse_g(pi, damping))
        except DecompositionError:
            self.failed_decompositions += 1
            return False
        if "inv_outer" in new:
            self.second_order.pop("eig_a", None)
            self.second_order.pop("eig_g", None)
        self.second_order.update(new)
        return True

    def finish_outer_product(self, damping: float) -> None:
        """Fold received eigenvalues into ``inv_outer`` (non-colocated factors)."""
        # The eigenvalues are kept (they are small) so that a later failed
        # decomposition of one factor can fall back to its previous values.
        so = self.second_order
        if "eig_a" in so and "eig_g" in so:
            so["inv_outer"] = eigen_outer_inverse(so["eig_g"], so["eig_a"], damping)

    @property
    def ready(self) -> bool:
        """Whether this rank holds everything needed to precondition the layer."""
        keys = self.second_order.keys()
        if {"a_inv", "g_inv"} <= keys:
            return True
        return {"qa", "qg"} <= keys and ("inv_outer" in keys or {"eig_a", "eig_g"} <= keys)

    # -- preconditioning ---------------------------------------------------
    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        so = self.second_order
        if "a_inv" in so:
            return precondition_inverse(grad, so["a_inv"], so["g_inv"])
        return precondition_eigen(
            grad,
            so["qa"],
            so["qg"],
            inv_outer=so.get("inv_outer"),
            eig_a=so.get("eig_a"),
            eig_g=so.get("eig_g"),
            damping=damping,
        )

    def memory(self) -> dict[str, int]:
        """Bytes held for this layer, by kind."""

        def nbytes(t: Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        pending = sum(nbytes(t) for t in self.pending.inputs) + sum(
            nbytes(g[0]) for g in self.pending.grads
        )
        return {
            "factors": nbytes(self.stats.A) + nbytes(self.stats.G),
            "batch_statistics": nbytes(self.stats.a_sum) + nbytes(self.stats.g_sum) + pending,
            "second_order": sum(nbytes(t) for t in self.second_order.values()),
        }
