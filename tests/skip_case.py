"""A training loop whose step BAD has a NaN loss, run with kaisa skipping it
or with the loop leaving it out: for tests that a skipped step is skipped
(tests/unit/step/test_skip.py, test_several_optimizers.py)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

STEPS, BAD = 8, 4  # the 5th step's loss is NaN (a factor step at factor_update_steps=2)


def run_with_a_nan_step(
    make: Callable[[nn.Module], torch.optim.Optimizer | list[torch.optim.Optimizer]],
    loop_skips: bool,
    model_fn: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> nn.Module:
    """STEPS steps; step BAD's loss is NaN. ``loop_skips``: the loop itself leaves that
    step out; else the loop runs it like any other and relies on kaisa. ``make``
    gives the optimizer, or the list of optimizers, stepping the model."""
    model = model_fn()
    made = make(model)
    opts = made if isinstance(made, list) else [made]
    precond = KFACPreconditioner(
        model, optimizer=made, factor_update_steps=2, inv_update_steps=4, damping=0.1
    )
    for i in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        x, y = batch(i)
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
        for opt in opts:
            opt.step()
    model.optimizer_states = [copy.deepcopy(o.state_dict()) for o in opts]  # type: ignore[assignment]
    return model


def assert_same_run(got: nn.Module, want: nn.Module) -> None:
    """Bit-identical finite weights and optimizer states (of :func:`_run`'s runs)."""
    for a, b in zip(got.parameters(), want.parameters(), strict=True):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)
    for state_a, state_b in zip(got.optimizer_states, want.optimizer_states, strict=True):
        assert state_a["state"].keys() == state_b["state"].keys()
        for key, values in state_a["state"].items():
            for field, value in values.items():
                other = state_b["state"][key][field]
                same = torch.equal(value, other) if torch.is_tensor(value) else value == other
                assert same, (key, field)
