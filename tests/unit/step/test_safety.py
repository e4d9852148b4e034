"""Steps kaisa must survive without a word lost: non-finite gradients and
forwards run in eval mode.

1. A step whose gradients hold a NaN or Inf (a NaN loss) is skipped: the
   running factors, the second-order state, the step count and the gradients
   are left exactly as they were, the step's statistics are dropped, and the
   next finite step proceeds as if the bad one had never happened.  The
   skips are counted and reported at the 1st, 2nd, 4th … one.
2. A forward in eval mode is not captured (it is not a training pass); a
   step whose layers ran only in eval mode says so and what to do.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.step.nonfinite import gradients_finite
from kfac_defaults import kfac_pytorch

#: kfac-pytorch's values where not set here (the module runs on the shipped defaults)
KW: dict[str, Any] = kfac_pytorch(damping=0.01, kl_clip=0.05, inv_update_steps=2)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(stem=nn.Linear(6, 8), act=nn.Tanh(), head=nn.Linear(8, 3))
    ).double()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (16,), generator=g
    )


def same_state(a: dict, b: dict) -> bool:
    if a["steps"] != b["steps"] or a["layers"].keys() != b["layers"].keys():
        return False
    return all(
        e.keys() == b["layers"][n].keys()
        and all(torch.equal(v, b["layers"][n][k]) for k, v in e.items())
        for n, e in a["layers"].items()
    )


def run(seeds: list[int], poisoned: dict[int, float]) -> dict[str, Any]:
    """SGD + K-FAC; the loss of batch ``s`` in ``poisoned`` is multiplied by
    ``poisoned[s]`` (NaN or Inf), and the loop, like a careful user, skips
    the optimizer step when the loss is not finite."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, **KW)
    out: dict[str, Any] = {"bad": []}
    for seed in seeds:
        x, y = batch(seed)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y) * poisoned.get(seed, 1.0)
        loss.backward()
        before = precond.state_dict(include_second_order=True)
        grads = [p.grad.clone() for p in model.parameters()]
        decompositions = sum(la.decompositions for la in precond.layers.values())
        precond.step()
        if torch.isfinite(loss):
            opt.step()
        else:
            out["bad"].append(
                {
                    "before": before,
                    "after": precond.state_dict(include_second_order=True),
                    "grads": grads,
                    "grads_after": [p.grad for p in model.parameters()],
                    "decomposed": sum(la.decompositions for la in precond.layers.values())
                    - decompositions,
                }
            )
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["state"] = precond.state_dict(include_second_order=True)
    out["nonfinite_steps"] = precond.nonfinite_steps
    return out


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_loss_is_skipped_and_leaves_kaisa_exactly_as_it_was(poison: float) -> None:
    clean = run([0, 1, 2, 3, 4], {})
    # step 2 is an inverse step (inv_update_steps=2): it must not decompose either
    with pytest.warns(UserWarning, match=r"skipped 1 step\(s\) with non-finite gradients"):
        got = run([0, 1, 9, 2, 3, 4], {9: poison})
    (bad,) = got["bad"]
    assert bad["before"]["steps"] == 2
    assert same_state(bad["before"], bad["after"])  # factors, second order, steps
    assert bad["decomposed"] == 0
    # the optimizer was given: its gradients were taken away (tests/unit/step/test_skip.py)
    assert all(not torch.isfinite(a).all() for a in bad["grads"])
    assert all(b is None for b in bad["grads_after"])
    # the statistics of the bad step were dropped: the rest is bit-for-bit the clean run
    for a, b in zip(got["params"], clean["params"]):
        assert torch.equal(a, b)
    assert same_state(got["state"], clean["state"])
    assert got["nonfinite_steps"] == 1 and clean["nonfinite_steps"] == 0


def test_skips_are_counted_and_reported_at_powers_of_two() -> None:
    seeds = [0, 11, 12, 13, 14, 15, 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(seeds, {s: float("nan") for s in seeds[1:-1]})
    said = [str(w.message) for w in caught if "non-finite gradients" in str(w.message)]
    assert [s.split(" step(s)")[0] for s in said] == [
        "kaisa: skipped 1",
        "kaisa: skipped 2",
        "kaisa: skipped 4",
    ], said
    assert got["nonfinite_steps"] == 5
    assert got["state"]["steps"] == 2


def test_gradients_finite_is_exact() -> None:
    f32 = torch.float32
    assert gradients_finite([])
    assert gradients_finite([torch.ones(3), torch.zeros(0)])
    # squares overflow float32 here; the entries are finite
    assert gradients_finite([torch.full((4,), 3e38, dtype=f32), torch.ones(2, dtype=torch.float64)])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(5, 5, dtype=f32)
        t[3, 1] = bad
        assert not gradients_finite([torch.ones(3, dtype=torch.float64), t]), bad
        big = torch.full((4,), 3e38, dtype=f32)
        big[0] = bad
        assert not gradients_finite([big]), bad


def test_a_nonfinite_batch_factor_is_still_rejected_by_the_fold() -> None:
    """Behind the step-level check, a non-finite batch factor that reaches
    the running average (finite gradients, a non-finite statistic) is
    rejected there and leaves the factor unchanged."""
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    layer = precond.layers["head"]
    kept = layer.factor("G").clone()
    bad = torch.full_like(kept, float("nan"))
    layer.fold(layer.index("G"), bad, 0.95)
    assert torch.equal(layer.factor("G"), kept) and layer.nonfinite_updates == 1


# -- eval mode ------------------------------------------------------------------------------------


def step_on(model: nn.Module, precond: KFACPreconditioner, seed: int) -> None:
    x, y = batch(seed)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    precond.step()


def test_training_in_eval_mode_from_the_start_names_eval_mode() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    model.eval()
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precond.step()
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert "'stem', 'head'" in said[0] and "eval mode" in said[0] and "model.train()" in said[0]
    assert not any("functionally" in s for s in said)
    for a, b in zip(raw, model.parameters()):  # nothing captured: raw gradients
        assert torch.equal(a, b.grad)


def test_a_step_after_an_eval_forward_says_eval_mode_once() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    step_on(model, precond, 0)
    kept = {n: la.factor("G").clone() for n, la in precond.layers.items()}
    model.eval()  # e.g. forgotten after an evaluation
    with pytest.warns(UserWarning, match=r"forward ran in eval mode \(model\.eval\(\)\)"):
        step_on(model, precond, 1)
    assert all(torch.equal(la.factor("G"), kept[n]) for n, la in precond.layers.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_on(model, precond, 2)  # said once
        model.train()
        step_on(model, precond, 3)
    assert not any(torch.equal(la.factor("G"), kept[n]) for n, la in precond.layers.items())


def test_an_eval_forward_that_is_not_backpropagated_is_ignored_silently() -> None:
    def run(evaluate: bool) -> dict:
        model = mlp()
        precond = KFACPreconditioner(model, lr=0.1, **KW)
        for seed in range(3):
            if evaluate:  # a validation pass with gradients on, never backpropagated
                model.eval()
                model(batch(50 + seed)[0]).sum()
                model.train()
            step_on(model, precond, seed)
        return precond.state_dict(include_second_order=True)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert same_state(run(True), run(False))
