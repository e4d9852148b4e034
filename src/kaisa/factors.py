"""Kronecker-factor statistics: per-batch contributions and running averages.

Conventions (stated in the README and tested against dense references):

* ``A = (1/R) Σ_r ā_r ā_rᵀ`` over all R rows (data points × positions × calls)
  a layer saw between two factor updates, ``ā`` the input row with a trailing
  one for the bias.
* ``G = (1/P) Σ_passes (1/N) Σ_rows ĝ ĝᵀ`` with N the batch size of the call,
  P the number of forward/backward passes accumulated (micro-batches), and
  ``ĝ = m · g`` where ``m`` undoes the loss averaging: ``m = N·k`` for a loss
  averaged over the batch, ``m = N·S·k`` for one averaged over batch and
  positions, ``m = 1`` for a summed loss; ``k`` is ``accumulation_steps``
  (the usual ``loss / k`` scaling of gradient accumulation), and a loss scale
  from a grad scaler is divided out as well.

With these, A⊗G approximates the Fisher of the mean-reduced loss and neither
depends on the batch size, the number of micro-batches or — since every rank
holds an equal share and the factors are averaged — the world size.

Everything here is pure tensor math on the canonical ``[rows, features]``
shape; nothing here knows about modules, hooks or processes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.config import LossAverage

__all__ = [
    "FactorStatistics",
    "all_finite",
    "grad_multiplier",
    "running_average_",
]


def grad_multiplier(
    loss_average: LossAverage, batch: int, positions: int, accumulation_steps: int
) -> float:
    """The factor ``m`` with ``ĝ = m·g`` that undoes the loss averaging."""
    if loss_average is LossAverage.BATCH:
        return float(batch * accumulation_steps)
    if loss_average is LossAverage.BATCH_AND_SEQUENCE:
        return float(batch * positions * accumulation_steps)
    return 1.0


def all_finite(t: Tensor) -> Tensor:
    """0-d bool: no NaN/Inf in ``t``, from one reduction (NaN and Inf propagate
    through a sum; a finite sum that overflows is treated as non-finite too).
    Several times cheaper than ``isfinite(t).all()``."""
    return torch.isfinite(t.sum())


def running_average_(running: Tensor, batch: Tensor, decay: float) -> Tensor:
    """In place: ``running ← decay·running + (1−decay)·batch``; returns "rejected".

    A non-finite ``batch`` leaves ``running`` unchanged.  The choice is made on
    device — the interpolation weight becomes 0 — so there is no host
    synchronisation and no temporary the size of the factor; ``batch`` is
    consumed (its non-finite entries are zeroed).
    """
    rejected = ~all_finite(batch)
    weight = (~rejected).to(running.dtype) * (1.0 - decay)
    batch.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    running.lerp_(batch, weight)
    return rejected


class FactorStatistics:
    """Accumulated batch statistics and running factors of one layer.

    ``add_a``/``add_g`` are called once per module call (from the hooks or,
    with ``update_factors_in_hook=False``, at ``step()``); :meth:`batch_factors`
    turns the sums into the batch factors defined in the module docstring.
    """

    def __init__(self, a_dim: int, g_dim: int) -> None:
        self.a_dim = a_dim
        self.g_dim = g_dim
        self.A: Tensor | None = None  #: running A (only where this rank keeps it)
        self.G: Tensor | None = None  #: running G
        self._rejected: Tensor | int = 0  # non-finite batch statistics, kept on device
        self.reset()

    def reset(self) -> None:
        self.a_sum: Tensor | None = None
        self.a_rows = 0
        self.g_sum: Tensor | None = None
        self.g_passes = 0
        self.calls = 0  # forward calls captured since reset
        self.grad_calls = 0  # backward (output-gradient) calls captured since reset
        self._last_pass: int | None = None

    @property
    def has_batch(self) -> bool:
        return self.a_sum is not None and self.g_sum is not None

    def add_a(self, a_rows: Tensor, dtype: torch.dtype) -> None:
        rows = a_rows.to(dtype)
        if self.a_sum is None:
            self.a_sum = rows.t() @ rows
        else:
            self.a_sum.addmm_(rows.t(), rows)
        self.a_rows += int(rows.shape[0])
        self.calls += 1

    def add_g(
        self,
        g_rows: Tensor,
        batch: int,
        multiplier: float | Tensor,
        pass_id: int,
        dtype: torch.dtype,
    ) -> None:
        """Add ``(m²/N) gᵀg`` of one call; ``pass_id`` counts micro-batches."""
        rows = g_rows.to(dtype)
        scale = multiplier * multiplier / batch
        if self.g_sum is None:
            self.g_sum = (rows.t() @ rows).mul_(scale)
        elif isinstance(scale, Tensor):  # a grad scaler's scale stays on device
            self.g_sum.add_((rows.t() @ rows).mul_(scale))
        else:
            self.g_sum.addmm_(rows.t(), rows, alpha=scale)
        if pass_id != self._last_pass:
            self.g_passes += 1
            self._last_pass = pass_id
        self.grad_calls += 1

    def batch_factors(self) -> tuple[Tensor, Tensor]:
        """The batch A and G since the last reset (computed in place: call once, then reset)."""
        if self.a_sum is None or self.g_sum is None:
            raise RuntimeError("no statistics captured for this layer")
        return self.a_sum.div_(self.a_rows), self.g_sum.div_(self.g_passes)

    def update(self, a_batch: Tensor | None, g_batch: Tensor | None, decay: float) -> None:
        """Fold (already reduced) batch factors into the running averages.

        Either factor may be ``None`` (this rank does not keep it).  A
        non-finite batch factor leaves its running factor unchanged.
        """
        if a_batch is not None:
            self.A = self._fold(self.A, a_batch, decay)
        if g_batch is not None:
            self.G = self._fold(self.G, g_batch, decay)

    def _fold(self, running: Tensor | None, batch: Tensor, decay: float) -> Tensor | None:
        if running is None:
            # No previous value to fall back to: one host sync, once per factor.
            if not bool(all_finite(batch)):
                self._rejected = self._rejected + 1
                return None
            return batch.clone()
        self._rejected = self._rejected + running_average_(running, batch, decay).to(torch.int64)
        return running

    @property
    def nonfinite_updates(self) -> int:
        """How many batch statistics were rejected as non-finite (syncs once)."""
        return int(self._rejected)
