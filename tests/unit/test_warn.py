"""kaisa's warnings name the user's line, however deep in kaisa (or torch) they are raised."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.warn import warn_user


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _train_step(model: nn.Module, precond: KFACPreconditioner, scale: float = 1.0) -> None:
    loss = model(torch.randn(16, 4)).square().mean() * scale
    loss.backward()
    precond.step()


def _kl_clip_without_lr() -> None:
    KFACPreconditioner(_mlp())


def _intervals_not_multiples() -> None:
    KFACPreconditioner(_mlp(), lr=0.1, factor_update_steps=3, inv_update_steps=7)


def _non_finite_step() -> None:
    model = _mlp()
    precond = KFACPreconditioner(model, lr=0.1)
    _train_step(model, precond, scale=float("nan"))


def _forward_in_eval_mode() -> None:
    model = _mlp()
    precond = KFACPreconditioner(model, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    _train_step(model, precond)
    model.eval()
    _train_step(model, precond)


def _forward_without_backward() -> None:
    model = _mlp()
    precond = KFACPreconditioner(model, lr=0.1)
    model(torch.randn(16, 4))
    _train_step(model, precond)


CASES: dict[str, tuple[Callable[[], None], str]] = {
    "kl clip without lr": (_kl_clip_without_lr, "the KL clip assumes a learning rate"),
    "intervals": (_intervals_not_multiples, "is not a multiple of factor_update_steps"),
    "non-finite": (_non_finite_step, "non-finite gradients"),
    "eval mode": (_forward_in_eval_mode, "eval mode"),
    "no backward": (_forward_without_backward, "with no backward before step()"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_warning_names_the_users_line(name: str) -> None:
    run, text = CASES[name]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    mine = [w for w in seen if text in str(w.message)]
    assert mine, [str(w.message) for w in seen]
    assert {w.filename for w in mine} == {__file__}, [(w.filename, w.lineno) for w in mine]


def test_warn_user_called_from_outside_kaisa_names_its_caller() -> None:
    with pytest.warns(FutureWarning, match="plain") as seen:
        warn_user("plain", FutureWarning)
    assert seen[0].filename == __file__
