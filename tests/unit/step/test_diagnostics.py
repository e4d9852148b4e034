"""The step's read-only diagnostics: the KL clip's ν, recorded only when asked.

ν is checked against its definition, ``min(1, √(c / (lr² Σ⟨V, ∇⟩)))`` with
``V`` the preconditioned gradient before the clip (recovered from a run with
the clip off, which is otherwise identical): a recorder that kept another
number, or recorded before ν was formed, fails.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.step.diagnostics import StepDiagnostics

LR = 0.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _grads(model: nn.Module, precond: KFACPreconditioner, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    raw = [p.grad.clone() for p in model.parameters()]
    precond.step()
    return raw


@pytest.mark.parametrize("kl_clip", [1e-4, 10.0], ids=["binding", "not-binding"])
def test_recorded_kl_scale_is_the_applied_one(kl_clip: float) -> None:
    model = _model()
    twin = copy.deepcopy(model)
    clipped = KFACPreconditioner(model, lr=LR, kl_clip=kl_clip, factor_update_steps=1)
    free = KFACPreconditioner(twin, lr=LR, kl_clip=None, factor_update_steps=1)
    clipped.diagnostics = diag = StepDiagnostics()
    free.diagnostics = free_diag = StepDiagnostics()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        raw = _grads(model, clipped, x)
        _grads(twin, free, x)
        v = [p.grad for p in twin.parameters()]
        vg = sum(float((a * b).sum()) for a, b in zip(v, raw))
        expected = min(1.0, math.sqrt(kl_clip / (LR * LR * vg)))
        nu = diag.kl_scales[-1]
        assert nu is not None and abs(nu - expected) <= 1e-12 * expected
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, nu * b.grad, rtol=1e-12, atol=0)
    assert len(diag.kl_scales) == 3 and free_diag.kl_scales == [None] * 3
    assert (diag.kl_scales[0] < 1.0) == (kl_clip < 1.0)


def test_off_by_default_and_detachable() -> None:
    model = _model()
    precond = KFACPreconditioner(model, lr=LR)
    assert precond.diagnostics is None
    x = torch.randn(8, 4, dtype=torch.float64)
    _grads(model, precond, x)  # nothing to fill: no error, nothing kept
    precond.diagnostics = diag = StepDiagnostics()
    _grads(model, precond, x)
    precond.diagnostics = None
    _grads(model, precond, x)
    assert len(diag.kl_scales) == 1
    with pytest.raises(TypeError, match="diagnostics must be"):
        precond.diagnostics = []  # type: ignore[assignment]
