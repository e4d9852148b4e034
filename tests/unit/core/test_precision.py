"""Opt-in lower precision for the products: ``precondition_dtype`` and ``factor_compute_dtype``.

Every bfloat16 path is checked against the float64 dense reference
(``kfac_reference``) within the bounds docs/numerics.md states:

* preconditioning products in bfloat16 (stored tensors in float32/float64):
  relative error of V ≤ 2e-2 and cosine ≥ 0.999 on well-conditioned layers.
  Each of ∇, Q_A, Q_G, the divisor and the four product outputs is rounded
  once to bfloat16 (unit roundoff u = 2⁻⁸, RMS relative rounding ≈ u/√3):
  about √8·u/√3 ≈ 6e-3 for a gradient spread over the eigenbasis, as measured
  here (3.6e-3 to 7e-3) — the bound leaves a factor of 3;
* Gram products in bfloat16: relative error of A ≤ 1e-2 (measured 1.3e-3 to
  2.8e-3: the rows and the product's output are rounded once each).

Each test also requires the error to be far above the float32 path's (≥ 1e-4
where float32 gives ~1e-6), so that a preconditioner that ignored the option
fails it.  Defaults are untouched: no copies, the stored tensors, identical
results.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.core.precision import CastCopies
from kaisa.core.specs import FactorKind, kfac_factors
from kaisa.core.statistics import contribution
from kaisa.methods import CurvatureMethod, EigenMethod, InverseMethod
from kaisa.methods.base import Operands

from kfac_reference import (
    conv_patches,
    dense_precondition,
    dense_precondition_pi,
    grad_matrix,
    outer_mean,
    per_example_output_grads,
    rel_err,
    with_ones,
)
from test_contracts import FACTOR_SETS, make_factors, reference, run_method

V_BOUND, COS_BOUND, A_BOUND = 2e-2, 0.999, 1e-2
TAKES_EFFECT = 1e-4  # a bfloat16 path's error is at least this; float32's is ~1e-6
DAMPING = 1e-3

METHODS: dict[str, CurvatureMethod] = {
    "eigen-outer": EigenMethod(outer_product=True),
    "eigen-plain": EigenMethod(outer_product=False),
    "inverse": InverseMethod(),
}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def spd(d: int, g: torch.Generator, lowest: float) -> torch.Tensor:
    """A float64 SPD matrix with eigenvalues evenly spread over [lowest, 1]."""
    q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    return (q * torch.linspace(lowest, 1.0, d, dtype=torch.float64)) @ q.t()


def decompose(method: CurvatureMethod, specs, factors, dtype: torch.dtype) -> dict:
    layer = Operands(specs, {}, [f.to(dtype) for f in factors])
    exchanged = method.exchange(layer)
    for transfer in method.transfers(specs, True):
        layer.state.update(method.decompose(layer, transfer.factors, DAMPING, dtype, exchanged))
    method.complete(layer, DAMPING, True)
    return layer.state


# -- precondition_dtype: the methods -----------------------------------------------------------


@pytest.mark.parametrize("lowest", [0.1, 0.01])
@pytest.mark.parametrize("shape", [(10, 33), (40, 65)])
@pytest.mark.parametrize("name", list(METHODS))
def test_bf16_products_within_bound_of_dense_reference(
    name: str, shape: tuple[int, int], lowest: float
) -> None:
    method = METHODS[name]
    d_out, d_in = shape
    g = torch.Generator().manual_seed(d_out * d_in)
    A, G = spd(d_in, g, lowest), spd(d_out, g, lowest)
    grad = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    dense = dense_precondition_pi if name == "inverse" else dense_precondition
    expected = dense(grad, A, G, DAMPING)
    specs = kfac_factors(d_in, d_out)
    state = decompose(method, specs, [A, G], torch.float32)
    fp32 = method.apply(Operands(specs, state), grad.float(), DAMPING)
    copies = Operands(specs, CastCopies(torch.bfloat16).of(state))
    bf16 = method.apply(copies, grad.float(), DAMPING)
    assert bf16.dtype == torch.float32  # returned in the gradient's dtype
    assert all(t.dtype == torch.float32 for t in state.values())  # stored tensors untouched
    err = rel_err(bf16.double(), expected)
    assert TAKES_EFFECT <= err <= V_BOUND
    assert cosine(bf16.double(), expected) >= COS_BOUND
    assert rel_err(fp32.double(), expected) <= 1e-5 < err


@pytest.mark.parametrize("factors", list(FACTOR_SETS))
@pytest.mark.parametrize("name", list(METHODS))
def test_bf16_products_on_diagonal_and_three_factor_layers(name: str, factors: str) -> None:
    """The tensordot path (three factors) and diagonal factors run in bfloat16 too."""
    method = METHODS[name]
    specs, values = make_factors(factors)
    shape = tuple(s.dim for s in sorted(specs, key=lambda s: s.axis))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = run_method(method, specs, values, grad, colocated=False)
    got = method.apply(Operands(specs, CastCopies(torch.bfloat16).of(state)), grad, 0.03)
    assert got.dtype == torch.float64
    expected = reference(specs, values, grad, "inverse" if name == "inverse" else "eigen")
    assert TAKES_EFFECT <= rel_err(got, expected) <= V_BOUND
    assert cosine(got, expected) >= COS_BOUND


# -- precondition_dtype: the preconditioner ----------------------------------------------------


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def batch(n: int = 40, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g, dtype=torch.float64), torch.randint(
        0, 5, (n,), generator=g
    )


def one_step(model: nn.Module, x, y, **kwargs) -> tuple[KFACPreconditioner, dict]:
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=None, **kwargs)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = {n: grad_matrix(la.adapter.module).clone() for n, la in precond.layers.items()}
    precond.step()
    return precond, raw


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_precondition_dtype_takes_effect_within_bound(method: str) -> None:
    x, y = batch()
    model = mlp()
    precond, raw = one_step(model, x, y, compute_method=method, precondition_dtype="bfloat16")
    dense = dense_precondition_pi if method == "inverse" else dense_precondition
    for name, layer in precond.layers.items():
        module = layer.adapter.module
        expected = dense(raw[name], layer.factor("A"), layer.factor("G"), 0.01)
        got = grad_matrix(module)
        assert got.dtype == torch.float64
        assert TAKES_EFFECT <= rel_err(got, expected) <= V_BOUND, name
        assert cosine(got, expected) >= COS_BOUND
        # what is stored (and broadcast, and saved) keeps inv_dtype
        assert all(t.dtype == torch.float64 for t in layer.state.values())
        assert all(t.dtype == torch.bfloat16 for t in layer.operands().values())


def test_default_uses_the_stored_tensors_themselves() -> None:
    x, y = batch()
    precond, _ = one_step(mlp(), x, y)
    for layer in precond.layers.values():
        assert layer.operands() is layer.state
        assert layer.cast.nbytes() == 0
    # and a precondition_dtype equal to inv_dtype copies nothing either
    precond, _ = one_step(mlp(), x, y, precondition_dtype=torch.float64)
    assert all(la.operands() is la.state for la in precond.layers.values())
    assert all(la.cast.nbytes() == 0 for la in precond.layers.values())


def test_cast_copies_are_made_per_inverse_update_and_counted_in_memory() -> None:
    model = mlp()
    precond = KFACPreconditioner(
        model, damping=0.01, inv_update_steps=3, precondition_dtype=torch.bfloat16
    )
    seen: list[dict[str, int]] = []
    sizes: list[dict[str, int]] = []
    for step in range(4):
        x, y = batch(seed=step)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        seen.append({k: id(v) for la in precond.layers.values() for k, v in la.operands().items()})
        sizes.append(precond.memory_usage())
    assert seen[0] == seen[1] == seen[2]  # steps 1, 2 reuse the copies of step 0's update
    assert seen[3] != seen[2]  # step 3 decomposed again: new copies
    stored = sum(
        t.numel() * t.element_size() for la in precond.layers.values() for t in la.state.values()
    )
    copies = sum(la.cast.nbytes() for la in precond.layers.values())
    assert copies == stored // 4  # bfloat16 copies of float64 tensors
    assert sizes[-1]["second_order"] == stored + copies


def test_cast_copy_is_dropped_with_its_source_and_remade_after_in_place_change() -> None:
    cache = CastCopies(torch.bfloat16)
    state = {"q": torch.eye(4), "v": torch.ones(4)}
    first = cache.of(state)
    assert cache.of(state)["q"] is first["q"]
    state["q"].mul_(2.0)  # modified in place: the copy is stale
    assert torch.equal(cache.of(state)["q"], torch.eye(4, dtype=torch.bfloat16) * 2)
    state.clear()  # sources freed: their copies go with them
    assert cache.nbytes() == 0


def test_checkpoint_round_trip_saves_stored_dtype_and_rebuilds_copies() -> None:
    model = mlp()
    x, y = batch()
    precond, _ = one_step(model, x, y, precondition_dtype="bfloat16")
    sd = precond.state_dict(include_second_order=True)
    default_sd = one_step(mlp(), x, y)[0].state_dict(include_second_order=True)
    for name, entry in sd["layers"].items():
        assert set(entry) == set(default_sd["layers"][name])
        assert all(t.dtype == torch.float64 for t in entry.values())
    other = copy.deepcopy(model)
    restored = KFACPreconditioner(other, damping=0.01, kl_clip=None, precondition_dtype="bfloat16")
    restored.load_state_dict(sd, compute_inverses=False)
    for ours, theirs in [(precond, restored), (restored, precond)]:
        for m in (model, other):
            m.zero_grad()
            F.cross_entropy(m(x), y).backward()
        ours.step()
        theirs.step()
        for a, b in zip(model.parameters(), other.parameters()):
            assert torch.equal(a.grad, b.grad)


# -- factor_compute_dtype ----------------------------------------------------------------------


@pytest.mark.parametrize("rows", [(128, 33), (2048, 65)])
def test_bf16_gram_within_bound(rows: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(rows[0])
    x = torch.relu(torch.randn(1, *rows, generator=g, dtype=torch.float64))  # a mean, like ReLU
    expected = outer_mean(x[0]) * rows[0]
    got = contribution(x.float(), FactorKind.DENSE, torch.float32, compute_dtype=torch.bfloat16)
    assert got.dtype == torch.float32
    assert TAKES_EFFECT <= rel_err(got.double(), expected) <= A_BOUND
    fp32 = contribution(x.float(), FactorKind.DENSE, torch.float32)
    assert rel_err(fp32.double(), expected) <= 1e-5
    # a diagonal factor has no product: formed in the factor dtype, exactly as before
    diag = contribution(x.float(), FactorKind.DIAGONAL, torch.float32, 2.0, torch.bfloat16)
    assert torch.equal(diag, contribution(x.float(), FactorKind.DIAGONAL, torch.float32, 2.0))


def _reference_factors(model, layer, x, y):
    inp, zg = per_example_output_grads(
        model, layer, x, lambda out: F.cross_entropy(out, y, reduction="none")
    )
    conv = isinstance(layer, nn.Conv2d)
    rows = with_ones(conv_patches(inp, layer) if conv else inp)
    g_rows = zg.permute(0, 2, 3, 1).reshape(-1, zg.shape[1]) if conv else zg
    return outer_mean(rows), g_rows.t() @ g_rows / inp.shape[0]


def test_factor_compute_dtype_takes_effect_on_linear_and_conv_within_bound() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 36, 5)
    ).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 3, 6, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (24,), generator=g)
    precond, _ = one_step(model, x, y, factor_compute_dtype=torch.bfloat16)
    for name, layer in precond.layers.items():
        A, G = _reference_factors(model, layer.adapter.module, x, y)
        for got, expected in ((layer.factor("A"), A), (layer.factor("G"), G)):
            assert got.dtype == torch.float64  # accumulated and stored in factor_dtype
            assert TAKES_EFFECT <= rel_err(got, expected) <= A_BOUND, name


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["precondition_dtype", "factor_compute_dtype"])
def test_options_refuse_float16_and_non_dtypes_naming_the_allowed_values(option: str) -> None:
    with pytest.raises(ValueError, match=rf"{option} must be None, float32, float64 or bfloat16"):
        KFACPreconditioner(mlp(), **{option: torch.float16})
    with pytest.raises(TypeError, match=rf"{option} must be None, float32, float64 or bfloat16"):
        KFACPreconditioner(mlp(), **{option: "bf16x"})
    KFACPreconditioner(mlp(), **{option: "torch.bfloat16"})


def test_factor_dtype_refuses_float16_for_its_range() -> None:
    """float16 factors underflow (squared output gradients below 6e-5) or
    overflow (a batch's sums past 65504): every batch would be dropped as
    non-finite or G would be zero, silently, so float16 is refused."""
    with pytest.raises(ValueError, match="factor_dtype must be bfloat16, float32 or float64"):
        KFACPreconditioner(mlp(), factor_dtype=torch.float16)
    with pytest.raises(ValueError, match="factor_dtype must be bfloat16"):
        KFACPreconditioner(mlp(), factor_dtype="half")
    KFACPreconditioner(mlp(), factor_dtype=torch.bfloat16)


@pytest.mark.parametrize("option", ["factor_dtype", "inv_dtype"])
def test_storage_dtypes_refuse_float8_naming_the_allowed_values(option: str) -> None:
    """float8 is floating point but has no arithmetic for a running average
    or a decomposition: refused at construction, not at the first step."""
    with pytest.raises(ValueError, match=rf"{option} must be one of .*torch.float32"):
        KFACPreconditioner(mlp(), **{option: torch.float8_e4m3fn})
