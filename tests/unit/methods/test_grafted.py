"""Grafting (``grafting='sgd'|'adam'``) against its dense float64 definition.

The reference is written from the definition, not from kaisa's code: per
layer, ``V₀`` is the eigen method's exact damped step on the row-major
vectorised gradient, ``vec(V₀) = (G ⊗ A + γI)⁻¹ vec(∇)`` (``torch.kron`` of
the layer's running factors, a dense solve), and the grafted step is
``V = V₀ · ‖D(∇)‖ / ‖V₀‖`` with ``D(∇) = ∇`` (sgd) or ``∇ / (√(v/(1−β₂ᵗ)) + ε)``,
``v ← β₂v + (1−β₂)∇²`` (adam).  With a KL clip, ``ν = min(1, √(c / (lr²
Σ⟨V, ∇⟩)))`` of the grafted ``V``.  Several steps with the weights moving;
Linear layers with bias and a Conv2d.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kaisa import Grafting, KFACConfig, KFACPreconditioner
from kaisa.methods.grafted import GraftedMethod
from kaisa.methods.inverse import InverseMethod

from kfac_reference import grad_matrix, rel_err

TOL = 1e-9
DAMPING = 0.05
STEPS = 5
BETA2, EPS = 0.999, 1e-8
LR = 0.1


def linear() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int]]:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, lambda g: torch.randn(16, 4, generator=g), [0, 2]


def conv2d() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int]]:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 2, bias=False)
    )
    return model, lambda g: torch.randn(8, 2, 4, 4, generator=g), [0, 3]


CASES = {"linear": linear, "conv2d": conv2d}


def dense_step(precond: KFACPreconditioner, name: str, grad: Tensor) -> Tensor:
    """``(G ⊗ A + γI)⁻¹ vec(∇)``, reshaped as ``∇``."""
    layer = precond.layers[name]
    a, g = layer.factor("A"), layer.factor("G")
    assert a is not None and g is not None
    k = torch.kron(g, a)
    eye = torch.eye(k.shape[0], dtype=torch.float64)
    return torch.linalg.solve(k + DAMPING * eye, grad.reshape(-1)).reshape(grad.shape)


class Graft:
    """One layer's grafting direction's norm, from the definition."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.v: Tensor | None = None
        self.t = 0

    def norm(self, grad: Tensor) -> float:
        if self.kind == "sgd":
            return float(grad.norm())
        self.t += 1
        sq = grad * grad
        self.v = (1 - BETA2) * sq if self.v is None else BETA2 * self.v + (1 - BETA2) * sq
        return float((grad / ((self.v / (1 - BETA2**self.t)).sqrt() + EPS)).norm())


def options(kind: str, kl_clip: float | None = None) -> dict[str, Any]:
    return dict(
        compute_method="eigen",
        grafting=kind,
        damping=DAMPING,
        factor_decay=0.7,
        factor_update_steps=1,
        inv_update_steps=1,
        kl_clip=kl_clip,
        lr=LR,
    )


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).square().sum()


@pytest.mark.parametrize("kl_clip", [None, 1e-4], ids=["no-clip", "clip"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("case", list(CASES))
def test_grafting_equals_its_dense_definition(case: str, kind: str, kl_clip: float | None) -> None:
    torch.manual_seed(0)
    model, draw, layers = CASES[case]()
    model = model.double()
    precond = KFACPreconditioner(model, **options(kind, kl_clip))
    grafts = {i: Graft(kind) for i in layers}
    gen = torch.Generator().manual_seed(1)
    clipped = 0
    for step in range(STEPS):
        x = draw(gen).double()
        with precond.paused():
            y = torch.randn(model(x).shape, generator=gen, dtype=torch.float64)
        model.zero_grad()
        loss_of(model(x), y).div(x.shape[0]).backward()
        raw = {i: grad_matrix(model[i]).clone() for i in layers}
        precond.step()
        expected = {}
        for i in layers:
            v0 = dense_step(precond, str(i), raw[i])
            expected[i] = v0 * (grafts[i].norm(raw[i]) / float(v0.norm()))
        nu = 1.0
        if kl_clip is not None:
            vg = sum(float((expected[i] * raw[i]).sum()) for i in layers) * LR * LR
            nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
            clipped += nu < 1.0
        for i in layers:
            got = grad_matrix(model[i])
            assert rel_err(got, nu * expected[i]) <= TOL, (case, kind, step, i)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
    if kl_clip is not None:
        assert clipped > 0  # the clip bound on some step: its order is tested
    if kind == "adam":
        assert float(precond.layers[str(layers[0])].state["graft_t"]) == STEPS


def train(model: nn.Module, precond: KFACPreconditioner, seed: int, steps: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen, dtype=torch.float64)
        model.zero_grad()
        loss_of(model(x), torch.randn(16, 3, generator=gen, dtype=torch.float64)).backward()
        precond.step()
        grads.extend(p.grad.clone() for p in model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
    return grads


def test_checkpoint_round_trip_keeps_the_second_moment() -> None:
    torch.manual_seed(0)
    model = linear()[0].double()
    twin = copy.deepcopy(model)
    opts = {**options("adam"), "inv_update_steps": 2}
    precond = KFACPreconditioner(model, **opts)
    train(model, precond, 0, 3)
    state = precond.state_dict(include_second_order=True)
    for name, layer in precond.layers.items():
        for key in ("graft_v", "graft_t"):
            assert torch.equal(state["layers"][name][key], layer.state[key]), (name, key)
    twin.load_state_dict(model.state_dict())
    restored = KFACPreconditioner(twin, **opts)
    restored.load_state_dict(state)
    ahead = train(model, precond, 5, 3)
    resumed = train(twin, restored, 5, 3)
    for a, b in zip(ahead, resumed):
        assert torch.equal(a, b)
    # without the second-order state v restarts at zero
    fresh = KFACPreconditioner(copy.deepcopy(twin), **opts)
    fresh.load_state_dict(precond.state_dict(include_second_order=False))
    train(fresh.model, fresh, 7, 1)
    assert float(fresh.layers["0"].state["graft_t"]) == 1.0


def test_sgd_grafting_gives_every_layer_its_gradient_norm_on_any_base() -> None:
    torch.manual_seed(0)
    model = linear()[0].double()
    precond = KFACPreconditioner(model, compute_method="inverse", grafting="sgd", kl_clip=None)
    x = torch.randn(16, 4, dtype=torch.float64)
    loss_of(model(x), torch.zeros(16, 3, dtype=torch.float64)).backward()
    raw = [grad_matrix(model[i]).clone() for i in (0, 2)]
    precond.step()
    for i, g in zip((0, 2), raw):
        v = grad_matrix(model[i])
        assert abs(float(v.norm()) / float(g.norm()) - 1.0) < 1e-12
        assert rel_err(v, g) > 1e-3  # the direction is K-FAC's, not the gradient's


@pytest.mark.parametrize("bad", ["adamw", "SGDM", 3, ""])
def test_a_bad_grafting_value_names_the_option_and_allowed_values(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"grafting must be .*'sgd'.*'adam'"):
        KFACConfig.from_options(grafting=bad)
    with pytest.raises(ValueError, match="grafting"):
        KFACPreconditioner(nn.Linear(2, 2), grafting=bad)


def test_grafting_spellings_and_wiring() -> None:
    assert KFACConfig.from_options(grafting="ADAM").grafting is Grafting.ADAM
    assert KFACConfig.from_options(grafting=None).grafting is None
    assert KFACConfig().grafting is None  # off by default
    precond = KFACPreconditioner(nn.Linear(2, 2), compute_method="inverse", grafting=Grafting.SGD)
    method = precond._parts.method
    assert isinstance(method, GraftedMethod) and isinstance(method.base, InverseMethod)
    with pytest.raises(ValueError, match=r"precondition_dtype.*grafting='adam'"):
        KFACPreconditioner(nn.Linear(2, 2), grafting="adam", precondition_dtype="bfloat16")
