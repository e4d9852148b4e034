"""torch.amp: autocast, loss scaling, skipped steps and bf16 factor storage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from kfac_reference import rel_err

KW: dict[str, Any] = dict(damping=0.01, kl_clip=0.05)


def mlp(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 6, generator=g).to(dtype), torch.randint(0, 3, (16,), generator=g)


def scaled_run(seeds: list[int], poisoned: int | None) -> tuple[list[torch.Tensor], dict, list]:
    """SGD + K-FAC with a GradScaler; batch ``poisoned`` produces Inf gradients."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    precond = KFACPreconditioner(model, optimizer=opt, grad_scaler=scaler, **KW)
    states = []
    for seed in seeds:
        x, y = batch(seed)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if seed == poisoned:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        before = precond.state_dict(include_second_order=True)
        precond.step()
        states.append((seed, before, precond.state_dict(include_second_order=True)))
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], precond.state_dict(), states


def same_state(a: dict, b: dict) -> bool:
    if a["steps"] != b["steps"]:
        return False
    return all(
        torch.equal(v, b["layers"][n][k]) for n, e in a["layers"].items() for k, v in e.items()
    )


def test_step_the_scaler_skips_leaves_kaisa_exactly_as_it_was() -> None:
    clean_params, clean_state, _ = scaled_run([0, 1, 2, 3, 4], poisoned=None)
    params, state, states = scaled_run([0, 1, 9, 2, 3, 4], poisoned=9)
    seed, before, after = states[2]
    assert seed == 9 and same_state(before, after)  # factors, decompositions, steps
    # Scales are powers of two, so the rest of the run is bit-for-bit the same
    for a, b in zip(params, clean_params):
        assert torch.equal(a, b)
    assert same_state(state, clean_state)


def test_step_before_unscale_is_refused_naming_unscale() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    precond = KFACPreconditioner(model, optimizer=opt, grad_scaler=scaler)
    x, y = batch(0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    with pytest.raises(RuntimeError, match=r"unscale_"):
        precond.step()
    scaler.unscale_(opt)  # the same step, done right, goes through
    precond.step()
    assert precond.steps == 1


def test_disabled_scaler_needs_no_unscale() -> None:
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    precond = KFACPreconditioner(model, grad_scaler=scaler)
    x, y = batch(0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    precond.step()


def g_factors(precond: KFACPreconditioner) -> dict[str, torch.Tensor]:
    return {n: la.factor("G") for n, la in precond.layers.items()}


def test_callable_loss_scale_is_divided_out() -> None:
    plain_model, scaled_model = mlp(), mlp()
    plain = KFACPreconditioner(plain_model, kl_clip=None)
    scaled = KFACPreconditioner(scaled_model, kl_clip=None, grad_scaler=lambda: 512.0)
    x, y = batch(0)
    F.cross_entropy(plain_model(x), y).backward()
    (F.cross_entropy(scaled_model(x), y) * 512.0).backward()
    for p in scaled_model.parameters():
        p.grad /= 512.0  # what a loss scaler's unscale does
    plain.step()
    scaled.step()
    for name, g in g_factors(plain).items():
        assert rel_err(g_factors(scaled)[name], g) <= 1e-12


@pytest.mark.parametrize(
    ("scale", "error"),
    [(float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError), ("x", TypeError)],
)
def test_a_callable_loss_scale_that_is_not_one_is_refused_by_name(
    scale: object, error: type
) -> None:
    """A NaN scale used to leave G unformed without a word, an Inf one made it
    zero, and 0 or a string failed deep in the capture."""
    model = mlp()
    precond = KFACPreconditioner(model, kl_clip=None, grad_scaler=lambda: scale)
    x, y = batch(0)
    with pytest.raises(error, match=r"the loss scale grad_scaler\(\) returns must be"):
        F.cross_entropy(model(x), y).backward()
        precond.step()


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_factors_accumulate_in_float32(autocast_dtype: torch.dtype) -> None:
    results = {}
    for dtype in (None, autocast_dtype):
        model = mlp(torch.float32)
        precond = KFACPreconditioner(model, **KW)
        x, y = batch(0, torch.float32)
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        precond.step()
        for layer in precond.layers.values():
            for name in ("A", "G"):
                assert layer.factor(name).dtype == torch.float32
            assert all(t.dtype == torch.float32 for t in layer.state.values())
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        results[dtype] = precond.state_dict()["layers"]
    for name, entry in results[None].items():
        for key, value in entry.items():
            assert rel_err(results[autocast_dtype][name][key], value) < 5e-2


def test_bf16_factor_storage_stays_finite_and_close() -> None:
    runs = {}
    for factor_dtype in (torch.float32, torch.bfloat16):
        model = mlp(torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFACPreconditioner(model, optimizer=opt, factor_dtype=factor_dtype, **KW)
        for seed in range(10):
            x, y = batch(seed, torch.float32)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            precond.step()
            opt.step()
        for layer in precond.layers.values():
            for name in ("A", "G"):
                factor = layer.factor(name)
                assert factor.dtype == factor_dtype and torch.isfinite(factor).all()
            assert all(t.dtype == torch.float32 for t in layer.state.values())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        runs[factor_dtype] = precond
    for name, layer in runs[torch.float32].layers.items():
        low = runs[torch.bfloat16].layers[name]
        for key in ("A", "G"):
            assert rel_err(low.factor(key).float(), layer.factor(key)) < 0.1
    memory = {d: p.memory_usage()["factors"] for d, p in runs.items()}
    assert memory[torch.bfloat16] * 2 == memory[torch.float32]
