"""The preconditioner's checkpoint methods, mixed into :class:`kaisa.KFACPreconditioner`.

``state_dict``/``load_state_dict`` follow torch.optim's convention (a
collective here: every rank gets the whole state, loadable at any world size
or fraction; see :mod:`kaisa.checkpoint.mirror`); ``sharded_state_dict``
hands ``torch.distributed.checkpoint`` each rank's share
(:mod:`kaisa.checkpoint.sharded`).  Kept apart so that the facade stays a
list of what a user calls, and each method here a few lines over the
checkpoint package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kaisa.checkpoint.sharded import restore_sharded, sharded_state
from kaisa.checkpoint.state import STATE_VERSION
from kaisa.compat import is_kfac_pytorch_state, refuse_kfac_pytorch_state
from kaisa.view import PreconditionerView

__all__ = ["Checkpoints"]


class Checkpoints(PreconditionerView):
    """``state_dict``, ``load_state_dict`` and their sharded twins."""

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(
        self,
        include_factors: bool = True,
        include_second_order: bool | None = None,
        *,
        timeout_s: float = 10.0,
    ) -> dict[str, Any]:
        """Steps, non-callable hyperparameters, the running factors and the
        eigenbases/inverses: everything an exact resume needs, as torch.optim's
        ``state_dict`` holds.

        When every rank of the data-parallel group calls it, every rank gets
        the whole state (a collective), so that a checkpoint taken at any
        world size and fraction loads into any other.
        ``include_second_order`` defaults to ``include_factors`` (so
        kfac-pytorch's ``state_dict(include_factors=False)`` still holds only
        the steps and hyperparameters); ``include_second_order=False`` leaves
        the eigenbases/inverses out: a
        smaller checkpoint (the factors' size again, roughly), whose resume
        recomputes them from the saved factors at the next step — so a run
        resumed between two inverse updates differs from the uninterrupted
        one (in the last digits at first; more as training goes on).

        Called on some ranks only (kfac-pytorch's examples save on rank 0
        only; kfac-pytorch keeps every factor on every rank, kaisa each on its
        owner), those ranks wait ``timeout_s`` for the others, then return,
        with a warning, what they hold: their own factors and second-order
        tensors, marked ``'partial'``.  Never a hang.  Loading it restores
        those layers and starts the others' statistics afresh.
        """
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "steps": self.steps,
            "hyperparameters": self._schedule.hyperparameters(),
        }
        if include_second_order is None:
            include_second_order = include_factors
        if not (include_factors or include_second_order):
            return state
        state["layers"], partial = self._parts.checkpointer.save(
            self.steps,
            include_factors,
            include_second_order,
            self._schedule.current("damping", self.steps),
            timeout_s,
            recompute_pending=self._parts.pipeline.second_order.stale,
        )
        if partial is not None:
            state["partial"] = partial
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], compute_inverses: bool = True) -> None:
        """Restore a :meth:`state_dict` taken at any world size, fraction or wrapper.

        The whole checkpoint is validated before anything changes.  Each rank
        keeps only the factors it owns under the current plan and only the
        second-order tensors of layers it is a gradient worker of.  Without
        stored second-order tensors they are recomputed by their owners at
        the next step (``compute_inverses``).
        """
        if is_kfac_pytorch_state(state_dict):
            raise refuse_kfac_pytorch_state()
        saved = state_dict.get("hyperparameters", {}) if isinstance(state_dict, Mapping) else {}
        restore = self._schedule.restorable(saved)
        steps, layers = self._parts.checkpointer.validate(state_dict, self.config, restore)
        pipeline = self._parts.pipeline
        if layers is not None:
            pipeline.second_order.stale = self._parts.checkpointer.load(
                layers, compute_inverses, partial=state_dict.get("partial")
            )
        self._schedule.restore(restore)
        pipeline.resume_at(steps)

    def sharded_state_dict(self, include_second_order: bool = True) -> dict[str, Any]:
        """This rank's share of the state for ``torch.distributed.checkpoint``:
        the factors it owns and the second-order tensors of the layers it is
        a gradient worker of (see :mod:`kaisa.checkpoint.sharded`), so the
        resume is exact, as :meth:`state_dict`'s.  ``include_second_order=False``
        keeps the factors only (their owners recompute the decompositions at
        the next step: a resume between two inverse updates then differs from
        the uninterrupted run).  Not collective; the same call's result is
        the template ``dcp.load`` fills."""
        damping = self._schedule.current("damping", self.steps)
        hyperparameters = self._schedule.hyperparameters()
        return sharded_state(self._parts, hyperparameters, self.rank, damping, include_second_order)

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`sharded_state_dict` filled by ``dcp.load``, taken at
        any world size or fraction (collective): bit for bit where the
        checkpoint holds the second-order tensors the new layout needs.  A
        part damaged on one rank (NaN, Inf, another dtype) is refused on
        every rank, before any of them changes."""
        restore_sharded(self._parts, self._schedule, self.config, self.rank, state)
