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
from skip_case import BAD, STEPS, assert_same_run, run_with_a_nan_step


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
    return run_with_a_nan_step(make, loop_skips, _model, _batch)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.needs_torch((2, 9), "torch.optim.Muon"))
        if n == "muon"
        else n
        for n in OPTIMIZERS
    ],
)
def test_a_skipped_step_leaves_weights_and_optimizer_state_as_a_loop_that_skipped_it(
    name: str,
) -> None:
    assert_same_run(
        _run(OPTIMIZERS[name], loop_skips=False), _run(OPTIMIZERS[name], loop_skips=True)
    )


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


FUSED: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd-fused": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, fused=True
    ),
    "adamw-fused": lambda m: torch.optim.AdamW(
        m.parameters(), lr=0.01, weight_decay=0.1, fused=True
    ),
}


def _deferred_run(
    make: Callable[[nn.Module], torch.optim.Optimizer], update_left_out: bool
) -> tuple[nn.Module, list[str]]:
    """The accelerator's rule on CPU (a non-factor step's verdict stays on the
    device): step BAD, a non-factor step, has a NaN loss; or, for the
    reference, finite gradients and no ``optimizer.step()``: kaisa counts the
    step either way, and the update is left out."""
    model = _model()
    opt = make(model)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=2, inv_update_steps=4, damping=0.1
    )
    precond.read_scalars = False
    said: list[str] = []
    for i in range(STEPS):
        opt.zero_grad()
        x, y = _batch(i)
        loss = F.cross_entropy(model(x), y)
        if i == BAD + 1 and not update_left_out:
            loss = loss * float("nan")
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        said += [str(w.message) for w in caught if "non-finite" in str(w.message)]
        if not (i == BAD + 1 and update_left_out):
            opt.step()
    model.optimizer_state = copy.deepcopy(opt.state_dict())  # type: ignore[assignment]
    model.kaisa_steps = (precond.steps, precond.nonfinite_steps)  # type: ignore[assignment]
    return model, said


@pytest.mark.parametrize("name", list(FUSED))
def test_a_fused_optimizer_skips_the_update_of_a_step_whose_verdict_stayed_on_the_device(
    name: str,
) -> None:
    """kaisa hands the device verdict to an optimizer that reads found_inf (the
    GradScaler contract): no host read, and the update is left out bit for bit."""
    got, said = _deferred_run(FUSED[name], update_left_out=False)
    want, _ = _deferred_run(FUSED[name], update_left_out=True)
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    for key, values in got.optimizer_state["state"].items():
        for field, value in values.items():
            assert torch.equal(value, want.optimizer_state["state"][key][field]), (key, field)
    assert len(said) == 1 and "the optimizer skipped its update on the device" in said[0]
    # the verdict was read at the next factor step, not in time to skip: the step counted
    assert got.kaisa_steps == (STEPS, 1) and want.kaisa_steps == (STEPS, 0)


def test_another_optimizer_is_told_how_to_have_such_steps_skipped() -> None:
    """An optimizer that reads no found_inf takes the NaN (the verdict was
    not read in time); the report says so and what skips such steps."""
    got, said = _deferred_run(OPTIMIZERS["sgd"], update_left_out=False)
    assert not all(torch.isfinite(p).all() for p in got.parameters())
    assert said and "its gradients went through" in said[0]
    assert "fused=True" in said[0] and "precond.read_scalars = True" in said[0]


def test_the_verdict_is_handed_only_while_attached() -> None:
    """A fused optimizer reads kaisa's found_inf until remove_hooks(); an
    unfused one is never given one (its step would refuse it)."""
    model = _model()
    fused = FUSED["sgd-fused"](model)
    precond = KFACPreconditioner(model, optimizer=fused)
    assert isinstance(fused.found_inf, torch.Tensor)  # type: ignore[attr-defined]
    precond.remove_hooks()
    assert not hasattr(fused, "found_inf")
    plain = OPTIMIZERS["sgd"](model)
    KFACPreconditioner(model, optimizer=plain)
    assert not hasattr(plain, "found_inf")
    scaled = FUSED["adamw-fused"](model)
    KFACPreconditioner(model, optimizer=scaled, grad_scaler=torch.amp.GradScaler("cpu"))
    assert not hasattr(scaled, "found_inf")  # the scaler hands its own
