"""Adam in K-FAC's eigenbasis (``compute_method='ekfac_adam'``) against its
dense float64 definition.

The reference works on the row-major vectorised gradient with the full
Kronecker basis ``K = Q_G ⊗ Q_A`` (``torch.kron``; ``Q`` from
``torch.linalg.eigh`` of the layer's running factors, dense even where kaisa
keeps a block-diagonal factor as blocks)::

    c = Kᵀ vec(∇);  m ← β₁m + (1−β₁)c;  v ← β₂v + (1−β₂)c²;  t ← t+1
    V = K [ (m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε) ]

and at every new basis ``P = K_oldᵀ K_new``: ``m ← Pᵀ m``, ``v ← (P∘P)ᵀ v``
(the whole ``P``, never its Kronecker factors).  Several steps with basis
refreshes in between; Linear with bias, Conv2d, a sequence Linear, a
block-diagonal factor.  Elementwise operations in an eigenbasis depend on the
basis within a degenerate eigenspace, so every compared factor is
nonsingular with distinct eigenvalues (more rows than its dimension).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.core.specs import FactorKind
from kaisa.methods import method_for
from kaisa.methods.base import Operands
from kaisa.methods.ekfac_adam import EKFACAdamMethod

from kfac_reference import grad_matrix, rel_err

TOL = 1e-8
DECAY = 0.7
INVERSE_EVERY = 2
STEPS = 6  # new bases at steps 0, 2 and 4
BETAS = (0.8, 0.9)
EPS = 1e-6


def linear() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int], dict]:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, lambda g: torch.randn(16, 4, generator=g), [0, 2], {}


def conv2d() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int], dict]:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 2, bias=False)
    )
    # the head's 48 inputs outnumber the 8 examples (a singular A): only the
    # convolution (2·9+1 rows of 128 patches) is compared
    return model, lambda g: torch.randn(8, 2, 4, 4, generator=g), [0], {}


def sequence() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int], dict]:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, lambda g: torch.randn(8, 6, 4, generator=g), [0, 2], {}


def blocks() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int], dict]:
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    # A of the first layer (7) and G (5) exceed 4: block-diagonal factors
    options = {"max_factor_dim": 4, "large_factor": "block"}
    return model, lambda g: torch.randn(16, 6, generator=g), [0, 2], options


CASES = {"linear": linear, "conv2d": conv2d, "sequence": sequence, "blocks": blocks}


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).square().sum()


def dense_basis(precond: KFACPreconditioner, name: str, factor: str) -> Tensor:
    """``Q`` of the layer's running factor, from a dense ``eigh``."""
    layer = precond.layers[name]
    spec = layer.factors[layer.index(factor)]
    value = layer.factor(factor)
    assert value is not None
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        value = spec.layout.dense(value)
    return torch.linalg.eigh(value)[1]


class Reference:
    """One layer's moments, in the vectorised gradient's coordinates."""

    def __init__(self, betas: tuple[float, float], eps: float) -> None:
        self.betas, self.eps = betas, eps
        self.basis: Tensor | None = None
        self.m = self.v = torch.zeros(0, dtype=torch.float64)
        self.t = 0

    def new_basis(self, qa: Tensor, qg: Tensor) -> None:
        k = torch.kron(qg, qa)
        if self.basis is None:
            self.m = self.v = torch.zeros(k.shape[0], dtype=torch.float64)
        else:
            p = self.basis.t() @ k
            self.m, self.v = p.t() @ self.m, (p * p).t() @ self.v
        self.basis = k

    def step(self, grad: Tensor) -> Tensor:
        assert self.basis is not None
        b1, b2 = self.betas
        c = self.basis.t() @ grad.reshape(-1)
        self.t += 1
        self.m = b1 * self.m + (1 - b1) * c
        self.v = b2 * self.v + (1 - b2) * c * c
        m_hat = self.m / (1 - b1**self.t) if b1 > 0 else c
        u = m_hat / ((self.v / (1 - b2**self.t)).sqrt() + self.eps)
        return (self.basis @ u).reshape(grad.shape)


def options(betas: tuple[float, float] = BETAS, **extra: Any) -> dict[str, Any]:
    return dict(
        method=EKFACAdamMethod(betas=betas, eps=EPS),
        factor_decay=DECAY,
        factor_update_steps=1,
        inv_update_steps=INVERSE_EVERY,
        kl_clip=None,
        **extra,
    )


@pytest.mark.parametrize("betas", [BETAS, (0.0, 0.9)], ids=["momentum", "no-momentum"])
@pytest.mark.parametrize("case", list(CASES))
def test_ekfac_adam_equals_its_dense_definition(case: str, betas: tuple[float, float]) -> None:
    torch.manual_seed(0)
    model, draw, checked, extra = CASES[case]()
    model = model.double()
    precond = KFACPreconditioner(model, **options(betas, **extra))
    refs = {i: Reference(betas, EPS) for i in checked}
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = draw(gen).double()
        with precond.paused():
            y = torch.randn(model(x).shape, generator=gen, dtype=torch.float64)
        model.zero_grad()
        loss_of(model(x), y).div(x.shape[0]).backward()
        raw = {i: grad_matrix(model[i]).clone() for i in checked}
        precond.step()
        for i in checked:
            if step % INVERSE_EVERY == 0:
                refs[i].new_basis(
                    dense_basis(precond, str(i), "A"), dense_basis(precond, str(i), "G")
                )
            expected = refs[i].step(raw[i])
            assert rel_err(grad_matrix(model[i]), expected) <= TOL, (case, step, i)
        with torch.no_grad():  # move the weights so that the factors' bases change
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
    layer = precond.layers[str(checked[0])]
    assert float(layer.state["adam_t"]) == STEPS
    assert ("adam_m" in layer.state) == (betas[0] > 0)


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


def test_checkpoint_round_trip_keeps_the_moments_with_their_bases() -> None:
    torch.manual_seed(0)
    model = linear()[0].double()
    twin = copy.deepcopy(model)
    precond = KFACPreconditioner(model, **options())
    train(model, precond, 0, 3)
    state = precond.state_dict(include_second_order=True)
    for name, layer in precond.layers.items():
        for key in ("adam_m", "adam_v", "adam_t"):
            assert torch.equal(state["layers"][name][key], layer.state[key]), (name, key)
    twin.load_state_dict(model.state_dict())
    restored = KFACPreconditioner(twin, **options())
    restored.load_state_dict(state)
    # the next steps, a new basis among them (step 4), are the same in both
    ahead = train(model, precond, 5, 2)
    resumed = train(twin, restored, 5, 2)
    for a, b in zip(ahead, resumed):
        assert torch.equal(a, b)
    # without the second-order state the moments restart with the recomputed bases
    fresh = KFACPreconditioner(copy.deepcopy(twin), **options())
    fresh.load_state_dict(precond.state_dict(include_second_order=False))
    train(fresh.model, fresh, 7, 1)
    assert float(fresh.layers["0"].state["adam_t"]) == 1.0


def test_options_and_refusals_name_the_parameter() -> None:
    method = method_for("ekfac_adam", True)
    assert isinstance(method, EKFACAdamMethod) and method.betas == (0.9, 0.95)
    for bad, word in (({"betas": (1.0, 0.9)}, "betas[0]"), ({"betas": (0.9, -0.1)}, "betas[1]")):
        with pytest.raises(ValueError, match=word.replace("[", r"\[")):
            EKFACAdamMethod(**bad)
    with pytest.raises(ValueError, match="eps"):
        EKFACAdamMethod(eps=0.0)
    with pytest.raises(ValueError, match=r"precondition_dtype.*ekfac_adam"):
        KFACPreconditioner(
            nn.Linear(3, 2), compute_method="ekfac_adam", precondition_dtype=torch.bfloat16
        )


def test_before_the_first_basis_it_is_adam_and_those_moments_are_rotated_in() -> None:
    """With no decomposition yet the stand-ins are the identity basis: the
    step is Adam's; the first real basis takes the moments along."""
    model = nn.Sequential(nn.Linear(3, 2)).double()
    specs = KFACPreconditioner(model, compute_method="ekfac_adam").layers["0"].factors
    method = EKFACAdamMethod(betas=BETAS, eps=EPS)
    like = torch.empty(0, dtype=torch.float64)
    state = {t.key: method.fallback(t, 2, 0.1, like) for t in method.held(specs, True)}
    ref = Reference(BETAS, EPS)
    ref.new_basis(torch.eye(4, dtype=torch.float64), torch.eye(2, dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    for grad in grads[:2]:
        assert rel_err(method.apply(Operands(specs, state), grad, 0.1), ref.step(grad)) <= TOL
    a = torch.randn(9, 4, generator=g, dtype=torch.float64)
    gm = torch.randn(9, 2, generator=g, dtype=torch.float64)
    running = [a.t() @ a if s.name == "A" else gm.t() @ gm for s in specs]
    new = method.decompose(Operands(specs, state, running), (0, 1), 0.1, torch.float64, None)
    method.receive(Operands(specs, state), new)
    qa = torch.linalg.eigh(running[[s.name for s in specs].index("A")])[1]
    qg = torch.linalg.eigh(running[[s.name for s in specs].index("G")])[1]
    ref.new_basis(qa, qg)
    last = method.apply(Operands(specs, state), grads[2], 0.1)
    assert rel_err(last, ref.step(grads[2])) <= TOL
