"""The KL clip: ``ν = min(1, sqrt(kl_clip / Σ lr²·⟨V, ∇⟩))``.

It is split in two so that its inner product can be summed over layers, and
over the ranks that hold other parts of the model, before the square root:
:func:`kl_term` / :func:`sum_kl_terms` form the inner products,
:func:`kl_scale` turns their sum into the scale every layer is multiplied by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["kl_scale", "kl_scale_value", "kl_term", "sum_kl_terms"]


def kl_term(preconditioned: Tensor, grad: Tensor) -> Tensor:
    """One layer's ``⟨V, ∇⟩`` as a 0-d tensor in ``V``'s dtype (summed over
    layers, and model-parallel groups, before :func:`kl_scale`)."""
    return torch.vdot(preconditioned.reshape(-1), grad.reshape(-1).to(preconditioned.dtype))


def sum_kl_terms(preconditioned: Sequence[Tensor], grads: Sequence[Tensor]) -> Tensor:
    """:func:`kl_term` of a matrix held as column blocks (same blocks on both sides)."""
    terms = [kl_term(v, g) for v, g in zip(preconditioned, grads)]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def kl_scale(inner: Tensor, lr: float | Tensor, kl_clip: float | Tensor) -> Tensor:
    """``ν = min(1, sqrt(kl_clip / |lr²·inner|))``; a zero inner product gives ν = 1."""
    vg = inner.abs() * (lr * lr)
    return torch.clamp(torch.sqrt(kl_clip / vg), max=1.0)


def kl_scale_value(inner: float, lr: float, kl_clip: float) -> float:
    """:func:`kl_scale` of a Python number (the inner product read on CPU,
    where reading it costs nothing): the same rule, NaN kept as NaN."""
    vg = abs(inner) * (lr * lr)
    if math.isnan(vg):
        return math.nan
    return 1.0 if vg == 0.0 else min(1.0, math.sqrt(kl_clip / vg))
