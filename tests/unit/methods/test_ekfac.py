"""EKFAC against its dense float64 definition (George et al. 2018).

Per-example gradients are computed one example at a time with autograd
(``N·∇W_n`` of the batch-mean loss is example n's own loss gradient), the
eigenbases by ``torch.linalg.eigh`` of the running factors, and

    S ← decay·S + (1 − decay)·mean_n (Q_Gᵀ ∇ℓ_n Q_A)²,  restarted at λ_G λ_Aᵀ
    V = Q_G [(Q_Gᵀ ∇ Q_A) / (S + γ)] Q_Aᵀ

step by step: the first decomposition and every inverse update restart S
from ``λ_G λ_Aᵀ`` (the eigen method's divisor); the factor steps between
fold per-example statistics formed with the current bases.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.distributed.plan import LayerSpec, make_plan
from kaisa.layers import LinearAdapter
from kaisa.layers.state import KFACLayer
from kaisa.methods import method_for
from kaisa.methods.ekfac import EKFACMethod, second_moment
from kaisa.planner.forecast import forecast, layer_costs
from kaisa.wiring import check_method_plan

from kfac_reference import grad_matrix, rel_err

TOL = 1e-8
DAMPING = 0.05
DECAY = 0.7
INVERSE_EVERY = 3
STEPS = 5  # inverse updates at steps 0 and 3


def linear() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int]]:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, lambda g: torch.randn(8, 4, generator=g), [0, 2]


def conv2d() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int]]:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(48, 2, bias=False)
    )
    # the head's 48 inputs outnumber the 8 examples: A is singular, its basis
    # not unique there, so only the convolution (2·9+1 rows of 128 patches) is compared
    return model, lambda g: torch.randn(8, 2, 4, 4, generator=g), [0]


def sequence() -> tuple[nn.Module, Callable[[torch.Generator], Tensor], list[int]]:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, lambda g: torch.randn(8, 6, 4, generator=g), [0, 2]


CASES = {"linear": linear, "conv2d": conv2d, "sequence": sequence}


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    """Summed over an example's outputs (and positions): ``ℓ_n``."""
    return (out - target).square().sum()


def basis(factor: Tensor) -> tuple[Tensor, Tensor]:
    values, vectors = torch.linalg.eigh(factor)
    return vectors, values.clamp(min=0.0)


def per_example_second_moment(
    model: nn.Module, index: int, x: Tensor, y: Tensor, qa: Tensor, qg: Tensor
) -> Tensor:
    """``mean_n (Q_Gᵀ ∇ℓ_n Q_A)²``, the gradients one example at a time."""
    terms = []
    for n in range(x.shape[0]):
        model.zero_grad()
        loss_of(model(x[n : n + 1]), y[n : n + 1]).backward()
        terms.append((qg.t() @ grad_matrix(model[index]) @ qa).square())
    return torch.stack(terms).mean(0)


def reference_v(grad: Tensor, qa: Tensor, qg: Tensor, s: Tensor) -> Tensor:
    return qg @ ((qg.t() @ grad @ qa) / (s + DAMPING)) @ qa.t()


@pytest.mark.parametrize("case", list(CASES))
def test_ekfac_equals_its_dense_definition(case: str) -> None:
    torch.manual_seed(0)
    model, draw, checked = CASES[case]()
    model = model.double()
    precond = KFACPreconditioner(
        model,
        compute_method="ekfac",
        damping=DAMPING,
        factor_decay=DECAY,
        factor_update_steps=1,
        inv_update_steps=INVERSE_EVERY,
        kl_clip=None,
    )
    gen = torch.Generator().manual_seed(1)
    held: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # index -> (Q_A, Q_G, S)
    for step in range(STEPS):
        x = draw(gen).double()
        with precond.paused():  # the reference's own passes are not captured
            y = torch.randn(model(x).shape, generator=gen, dtype=torch.float64)
            if step % INVERSE_EVERY:  # a factor step between inverse updates: S folds
                for i in checked:
                    qa, qg, s = held[i]
                    moment = per_example_second_moment(model, i, x, y, qa, qg)
                    held[i] = (qa, qg, DECAY * s + (1 - DECAY) * moment)
        model.zero_grad()
        loss_of(model(x), y).div(x.shape[0]).backward()
        raw = {i: grad_matrix(model[i]).clone() for i in checked}
        precond.step()
        for i in checked:
            layer = precond.layers[str(i)]
            if step % INVERSE_EVERY == 0:  # new bases: S restarts from λ_G λ_Aᵀ
                qa, la = basis(layer.factor("A"))
                qg, lg = basis(layer.factor("G"))
                held[i] = (qa, qg, torch.outer(lg, la))
            qa, qg, s = held[i]
            assert rel_err(layer.state["ekfac_s"], s) <= TOL, (case, step, i)
            expected = reference_v(raw[i], qa, qg, s)
            assert rel_err(grad_matrix(model[i]), expected) <= TOL, (case, step, i)


def test_second_moment_of_one_position_equals_the_per_example_products() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 1, 5, generator=g, dtype=torch.float64)
    gr = torch.randn(7, 1, 3, generator=g, dtype=torch.float64)
    explicit = sum(torch.outer(gr[n, 0], a[n, 0]).square() for n in range(7))
    assert rel_err(second_moment(gr, a), explicit) <= 1e-12
    # and the chunked path (several positions) sums the per-example matrices
    a = torch.randn(7, 4, 5, generator=g, dtype=torch.float64)
    gr = torch.randn(7, 4, 3, generator=g, dtype=torch.float64)
    explicit = sum((gr[n].t() @ a[n]).square() for n in range(7))
    assert rel_err(second_moment(gr, a), explicit) <= 1e-12


def train_two_steps(model: nn.Module, precond: KFACPreconditioner, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2):
        x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
        model.zero_grad()
        loss_of(model(x), torch.randn(8, 3, generator=gen, dtype=torch.float64)).backward()
        precond.step()


def options() -> dict:
    return dict(
        compute_method="ekfac",
        damping=DAMPING,
        factor_decay=DECAY,
        factor_update_steps=1,
        inv_update_steps=INVERSE_EVERY,
        kl_clip=None,
    )


def test_checkpoint_round_trip_keeps_s_with_its_bases() -> None:
    torch.manual_seed(0)
    model, _, _ = linear()
    model = model.double()
    twin = copy.deepcopy(model)
    precond = KFACPreconditioner(model, **options())
    train_two_steps(model, precond, 0)  # S has per-example statistics now
    state = precond.state_dict(include_second_order=True)
    for name, layer in precond.layers.items():
        assert torch.equal(state["layers"][name]["ekfac_s"], layer.state["ekfac_s"])
    restored = KFACPreconditioner(twin, **options())
    restored.load_state_dict(state)
    for name, layer in restored.layers.items():
        assert torch.equal(layer.state["ekfac_s"], precond.layers[name].state["ekfac_s"])
    # the next (factor, not inverse) step is the same in both
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    for m, p in ((model, precond), (twin, restored)):
        m.zero_grad()
        loss_of(m(x), y).backward()
        p.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
    # without the bases S restarts from the recomputed ones' eigenvalues
    fresh = KFACPreconditioner(copy.deepcopy(twin), **options())
    fresh.load_state_dict(precond.state_dict())
    fresh.model.zero_grad()
    loss_of(fresh.model(x), y).backward()
    fresh.step()
    layer = fresh.layers["0"]
    _, la = basis(layer.factor("A"))
    _, lg = basis(layer.factor("G"))
    assert rel_err(layer.state["ekfac_s"], torch.outer(lg, la)) <= TOL


def test_fractions_below_one_are_refused_with_the_reason() -> None:
    method = method_for("ekfac", True)
    assert isinstance(method, EKFACMethod)
    adapter = LinearAdapter("fc", nn.Linear(4, 3))
    layer = KFACLayer(
        adapter,
        torch.float32,
        torch.float32,
        statistics=method.statistics(adapter.effective_specs()),
    )
    specs = [LayerSpec("fc", layer.factors)]
    check_method_plan(method, [layer], make_plan(specs, 4, 1.0), "1")
    for fraction in (0.5, 0.25):
        with pytest.raises(ValueError) as err:
            check_method_plan(method, [layer], make_plan(specs, 4, fraction), f"{fraction:g}")
        message = str(err.value)
        assert f"grad_worker_fraction={fraction:g}" in message
        assert "compute_method='ekfac'" in message and "eigenbases" in message


def test_forecast_reads_the_declared_statistic() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    layers = layer_costs(model)
    ekfac = forecast(layers, 2, compute_method="ekfac")
    eigen = forecast(layers, 2, compute_method="eigen")
    # S (d_G × d_A, float64) summed onto every rank per factor step; held on every worker
    assert ekfac.bytes_factor_step["statistic_allreduce"][0] == 8 * (5 * 5 + 3 * 6)
    assert eigen.bytes_factor_step["statistic_allreduce"][0] == 0
    assert ekfac.memory["second_order"][0] > 0


def test_scales_that_overflow_off_their_diagonal_are_rejected() -> None:
    """S is not a Gram: one entry ``Σ (Q_Gᵀ g)_i² (Q_Aᵀ a)_j²`` can overflow
    where S's diagonal, A, G and the gradient stay finite (a large input in
    one feature, a large output gradient in another, in one example).  The
    batch is rejected, as a non-finite factor is, and S stays finite."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4, bias=False)  # a square S: its diagonal alone would pass
    with torch.no_grad():
        layer.weight.copy_(torch.eye(4))
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    precond = _ekfac_every_step(layer, opt, inv_update_steps=100, damping=0.01, loss_average="sum")

    def step(x: Tensor, out_grad: Tensor) -> bool:
        opt.zero_grad()
        (layer(x) * out_grad).sum().backward()
        return precond.step()

    plain, scales = torch.diag(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.eye(4).flip(0)
    step(plain, scales)  # the bases: near the identity
    x, g = torch.eye(4), torch.eye(4)
    x[0, 0], x[0, 1], g[0, 0] = 0.0, 1e10, 1e10  # S[0, 1] ~ 1e40: beyond float32
    step(x, g)
    (state,) = (la.state for la in precond.layers.values())
    assert torch.isfinite(state["ekfac_s"]).all()
    assert step(plain, scales)  # the next step preconditions with finite scales
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


def test_a_failed_decomposition_keeps_the_bases_and_s_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An inverse update whose eigh fails keeps the previous bases; S, held in
    them, goes on too: the run equals one whose step had no inverse update."""

    def run(inverse_every: int, fail_at: int | None) -> tuple[dict, list[Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        precond = _ekfac_every_step(model, opt, inv_update_steps=inverse_every, damping=DAMPING)
        g = torch.Generator().manual_seed(1)
        for step in range(5):
            x = torch.randn(7, 5, generator=g, dtype=torch.float64)
            opt.zero_grad()
            model(x).logsumexp(-1).mean().backward()
            with monkeypatch.context() as patch:
                if step == fail_at:
                    patch.setattr(torch.linalg, "eigh", _failing_eigh)
                precond.step()
            opt.step()
        return precond.state_dict(), [p.detach().clone() for p in model.parameters()]

    want_state, want = run(inverse_every=8, fail_at=None)  # no inverse update at step 4
    got_state, got = run(inverse_every=4, fail_at=4)  # one that fails there
    for name, entry in want_state["layers"].items():
        for key, value in entry.items():
            assert torch.equal(got_state["layers"][name][key], value), (name, key)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _failing_eigh(*args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
    raise torch.linalg.LinAlgError("eigh did not converge (injected)")


def _ekfac_every_step(
    model: nn.Module, opt: torch.optim.Optimizer, **options: Any
) -> KFACPreconditioner:
    """EKFAC folding factors and S every step, no KL clip."""
    return KFACPreconditioner(
        model, optimizer=opt, compute_method="ekfac", factor_update_steps=1, kl_clip=None, **options
    )
