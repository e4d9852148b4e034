"""A step skipped for non-finite gradients is skipped: the user's loop changes nothing.

With ``optimizer=`` given, kaisa takes the optimizer's gradients away on such a
step, so the loop's ``optimizer.step()`` right after changes no weight and no
optimizer state: the run is bit-identical to a loop that skipped the step
itself. Without it, ``step()`` returns False and the warning says what to do.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

STEPS, BAD = 8, 4  # the 5th step's loss is NaN (a factor step at factor_update_steps=2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # no biases: torch's Muon takes 2-D parameters only
    return nn.Sequential(nn.Linear(6, 12, bias=False), nn.Tanh(), nn.Linear(12, 3, bias=False))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    "muon": lambda m: torch.optim.Muon(m.parameters(), lr=0.02, weight_decay=0.1),
}


def _run(make: Callable[[nn.Module], torch.optim.Optimizer], loop_skips: bool) -> nn.Module:
    """STEPS steps; step BAD's loss is NaN. ``loop_skips``: the loop itself leaves that
    step out; else the loop runs it like any other and relies on kaisa."""
    model = _model()
    opt = make(model)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=2, inv_update_steps=4, damping=0.1
    )
    for i in range(STEPS):
        opt.zero_grad()
        x, y = _batch(i)
        if i == BAD and loop_skips:
            continue
        loss = F.cross_entropy(model(x), y)
        if i == BAD:
            loss = loss * float("nan")
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            applied = precond.step()
        assert applied is (i != BAD)
        opt.step()
    model.optimizer_state = copy.deepcopy(opt.state_dict())  # type: ignore[assignment]
    return model


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_a_loop_that_skipped_it(
    name: str,
) -> None:
    kaisa_skips = _run(OPTIMIZERS[name], loop_skips=False)
    loop_skips = _run(OPTIMIZERS[name], loop_skips=True)
    for a, b in zip(kaisa_skips.parameters(), loop_skips.parameters(), strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    state_a, state_b = kaisa_skips.optimizer_state, loop_skips.optimizer_state
    assert state_a["state"].keys() == state_b["state"].keys()
    for key, values in state_a["state"].items():
        for field, value in values.items():
            other = state_b["state"][key][field]
            same = torch.equal(value, other) if torch.is_tensor(value) else value == other
            assert same, (name, key, field)


def test_the_warning_says_the_gradients_were_taken_and_names_each_call() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt)
    said = []
    for i in range(3):
        opt.zero_grad()
        x, y = _batch(i)
        (F.cross_entropy(model(x), y) * (float("nan") if i else 1.0)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        said += [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(said) == 2  # the 1st and the 2nd skip are reported
    assert "latest at call 2 of step()" in said[0] and "latest at call 3 of step()" in said[1]
    assert "taken away (set to None)" in said[0]
    assert all(p.grad is None for p in model.parameters())
    assert precond.steps == 1 and precond.nonfinite_steps == 2


def test_without_the_optimizer_step_says_false_and_leaves_the_gradients() -> None:
    model = _model()
    precond = KFACPreconditioner(model, lr=0.1)
    x, y = _batch(0)
    (F.cross_entropy(model(x), y) * float("inf")).backward()
    with pytest.warns(UserWarning, match=r"step\(\) returned False, so skip optimizer.step\(\)"):
        assert precond.step() is False
    assert all(p.grad is not None and not torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert precond.step() is True
