"""Contract suites: every curvature method and every engine meets the same checks.

* Methods: the preconditioned gradient equals a dense float64 reference built
  with ``torch.kron`` and an exact solve — for two dense factors, a dense and a
  diagonal factor, and three factors — whether the factors are decomposed
  together or by different owners; the damping-only fallback applies ∇/γ;
  the declared tensors are exactly what is held, with their shapes.
* Engines: a gradient read and written back is unchanged, a written matrix
  reads back, wrappers unwrap, and a backward pass moves the gradient marks.
* Where K-FAC is exact (one datum), kaisa equals the exact curvature block.
* A layer type with a diagonal factor trains end to end against the dense
  reference (capture, plan, reduction, checkpoint, method).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.core.specs import FactorKind, FactorSource, FactorSpec
from kaisa.core.workspace import Workspace
from kaisa.engines import (
    Engine,
    GradientMarks,
    InPlaceGradients,
    ModelParallelLayers,
    OwnsTheLoop,
    ShardedReads,
    TorchEngine,
)
from kaisa.layers import LinearAdapter, register_layer_type
from kaisa.layers.registry import _ADAPTERS
from kaisa.methods import CurvatureMethod, EigenMethod, InverseMethod
from kaisa.methods.base import Operands
from kaisa.methods.capabilities import ColumnBlockApply
from kaisa.methods.eigen import EigenBasis
from kaisa.methods.ekfac import EKFACMethod
from kaisa.methods.ekfac_adam import EKFACAdamMethod

from kfac_reference import grad_matrix, rel_err, unvec, vec

#: on kaisa's shipped defaults; a test that needs another value passes it

TOL = 1e-8
DAMPING = 0.03

METHODS: dict[str, CurvatureMethod] = {
    "eigen-outer": EigenMethod(outer_product=True),
    "eigen-plain": EigenMethod(outer_product=False),
    "inverse": InverseMethod(),
    # right after a decomposition S = λ_G λ_Aᵀ: the eigen method's result
    "ekfac": EKFACMethod(),
    # Adam in the eigenbasis: its first step after a decomposition is
    # C/(|C| + ε) there (adam_reference), its stand-ins plain Adam's ∇/(|∇| + ε)
    "ekfac-adam": EKFACAdamMethod(eps=1e-3),
}

# factor sets: (kind, dim, axis) per factor
FACTOR_SETS = {
    "dense-dense": [(FactorKind.DENSE, 5, 1), (FactorKind.DENSE, 4, 0)],
    "diag-dense": [(FactorKind.DIAGONAL, 5, 1), (FactorKind.DENSE, 4, 0)],
    "three-dense": [(FactorKind.DENSE, 3, 0), (FactorKind.DENSE, 4, 1), (FactorKind.DENSE, 2, 2)],
}


def make_factors(which: str, seed: int = 0) -> tuple[list[FactorSpec], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    specs, values = [], []
    for i, (kind, dim, axis) in enumerate(FACTOR_SETS[which]):
        specs.append(FactorSpec(f"F{i}", kind, dim, axis, FactorSource.INPUT))
        x = torch.randn(3 * dim, dim, generator=g, dtype=torch.float64)
        spd = x.t() @ x / (3 * dim) + 0.1 * torch.eye(dim, dtype=torch.float64)
        values.append(spd if kind is FactorKind.DENSE else spd.diagonal().clone())
    return specs, values


def dense(spec: FactorSpec, value: torch.Tensor) -> torch.Tensor:
    return value if spec.kind is FactorKind.DENSE else torch.diag(value)


def column_major(x: torch.Tensor) -> torch.Tensor:
    return x.permute(*reversed(range(x.dim()))).reshape(-1)


def reference(specs, values, grad: torch.Tensor, method: str) -> torch.Tensor:
    """Dense solve: ``(F_{N-1} ⊗ … ⊗ F_0 [+ γI])⁻¹ vec(∇)`` with column-major vec."""
    by_axis = sorted(zip(specs, values), key=lambda sv: sv[0].axis)
    mats = [dense(s, v) for s, v in by_axis]
    n = len(mats)
    if method == "inverse":
        t = torch.tensor([torch.trace(m) / m.shape[0] for m in mats], dtype=torch.float64)
        pis = t / t.prod() ** (1.0 / n)
        mats = [
            m + DAMPING ** (1.0 / n) * p * torch.eye(m.shape[0], dtype=m.dtype)
            for m, p in zip(mats, pis)
        ]
    big = mats[-1]
    for m in reversed(mats[:-1]):
        big = torch.kron(big, m)
    if method != "inverse":
        big = big + DAMPING * torch.eye(big.shape[0], dtype=big.dtype)
    v = torch.linalg.solve(big, column_major(grad))
    shape = tuple(s.dim for s, _ in by_axis)
    return v.reshape(tuple(reversed(shape))).permute(*reversed(range(n)))


def adam_reference(specs, values, grad: torch.Tensor, eps: float) -> torch.Tensor:
    """Adam's first step in the Kronecker eigenbasis, dense: ``K (c / (|c| + ε))``
    with ``c = Kᵀ vec(∇)``, ``K`` the Kronecker product of the eigenbases
    (column-major vec, as :func:`reference`)."""
    by_axis = sorted(zip(specs, values), key=lambda sv: sv[0].axis)
    bases = [torch.linalg.eigh(dense(s, v))[1] for s, v in by_axis]
    big = bases[-1]
    for q in reversed(bases[:-1]):
        big = torch.kron(big, q)
    c = big.t() @ column_major(grad)
    v = big @ (c / (c.abs() + eps))
    shape = tuple(s.dim for s, _ in by_axis)
    return v.reshape(tuple(reversed(shape))).permute(*reversed(range(len(shape))))


def run_method(method: CurvatureMethod, specs, values, grad, colocated: bool) -> dict:
    layer = Operands(specs, {}, list(values))
    exchanged = method.exchange(layer)
    for transfer in method.transfers(specs, colocated):
        new = method.decompose(layer, transfer.factors, DAMPING, torch.float64, exchanged)
        layer.state.update(new)
    method.complete(layer, DAMPING, colocated)
    return layer.state


@pytest.mark.parametrize("factors", list(FACTOR_SETS))
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("colocated", [True, False])
def test_method_equals_dense_reference(name: str, factors: str, colocated: bool) -> None:
    method = METHODS[name]
    specs, values = make_factors(factors)
    shape = tuple(s.dim for s in sorted(specs, key=lambda s: s.axis))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = run_method(method, specs, values, grad, colocated)
    assert method.ready(Operands(specs, state), colocated)
    got = method.apply(Operands(specs, state), grad, DAMPING)
    if isinstance(method, EKFACAdamMethod):
        expected = adam_reference(specs, values, grad, method.eps)
    else:
        expected = reference(specs, values, grad, "inverse" if name == "inverse" else "eigen")
    assert rel_err(got, expected) <= TOL


@pytest.mark.parametrize("name", list(METHODS))
def test_column_blocks_equal_apply_wherever_a_method_offers_them(name: str) -> None:
    """A method that says it can precondition a gradient held as column
    blocks (the CPU workspace fast path) gives :meth:`apply`'s result there:
    a method that divides by something else than the eigen method's
    eigenvalues (EKFAC's S, Adam's moments) must not inherit the eigen
    method's block path (a capability, :mod:`kaisa.methods.capabilities`)."""
    method = METHODS[name]
    specs, values = make_factors("dense-dense")
    grad = torch.randn(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = run_method(method, specs, values, grad, True)
    if isinstance(method, EigenBasis):
        # right after a decomposition EKFAC's S is the eigen divisor and
        # Adam's moments are zero: move what a subclass holds beyond the
        # eigen method's tensors, so that inheriting its block path shows
        plain = EigenMethod(outer_product=method.outer_product).held(specs, True)
        for key in set(state) - {h.key for h in plain}:
            state[key] = state[key] * 1.5 + 0.25
    offers = isinstance(method, ColumnBlockApply)
    assert offers == (name in ("eigen-outer", "eigen-plain", "inverse"))
    if not offers or not method.writes_blocks(Operands(specs, state), grad.dtype):
        return
    expected = method.apply(Operands(specs, dict(state)), grad.clone(), DAMPING)
    blocks = [grad[:, :3].clone(), grad[:, 3:].clone()]
    out = [torch.empty_like(b) for b in blocks]
    work = Workspace.for_shapes([grad.shape], grad.device)
    method.apply_blocks(Operands(specs, state), blocks, DAMPING, work, out, False)
    assert rel_err(torch.cat(out, dim=1), expected) <= TOL


@pytest.mark.parametrize("factors", list(FACTOR_SETS))
@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("colocated", [True, False])
def test_method_declares_what_it_holds(name: str, factors: str, colocated: bool) -> None:
    method = METHODS[name]
    specs, values = make_factors(factors)
    shape = tuple(s.dim for s in sorted(specs, key=lambda s: s.axis))
    state = run_method(method, specs, values, torch.zeros(shape, dtype=torch.float64), colocated)
    held = {t.key: t.shape for t in method.held(specs, colocated)}
    assert set(held) <= set(state)
    for key, shape_ in held.items():
        assert tuple(state[key].shape) == shape_, key
    sent = {t.key for tr in method.transfers(specs, colocated) for t in tr.tensors}
    assert sent <= set(state)
    # every factor is decomposed by exactly one transfer
    owned = sorted(i for tr in method.transfers(specs, colocated) for i in tr.factors)
    assert owned == list(range(len(specs)))
    # a copy of exactly the held tensors (a checkpoint round trip) applies the same
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    restored = {k: state[k].clone() for k in held}
    assert torch.equal(
        method.apply(Operands(specs, restored), grad, DAMPING),
        method.apply(Operands(specs, state), grad, DAMPING),
    )


@pytest.mark.parametrize("factors", list(FACTOR_SETS))
@pytest.mark.parametrize("name", list(METHODS))
def test_method_fallback_applies_gradient_over_damping(name: str, factors: str) -> None:
    method = METHODS[name]
    specs, _ = make_factors(factors)
    like = torch.empty(0, dtype=torch.float64)
    state = {t.key: method.fallback(t, len(specs), DAMPING, like) for t in method.held(specs, True)}
    shape = tuple(s.dim for s in sorted(specs, key=lambda s: s.axis))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if isinstance(method, EKFACAdamMethod):  # Adam's first step in the identity basis
        expected = grad / (grad.abs() + method.eps)
    else:
        expected = grad / DAMPING
    assert rel_err(method.apply(Operands(specs, state), grad, DAMPING), expected) <= 1e-12


# -- engines ----------------------------------------------------------------------------------

ENGINES: dict[str, type[Engine]] = {"torch": TorchEngine}


@pytest.mark.parametrize("engine_name", list(ENGINES))
def test_engine_reads_writes_unwraps_and_marks(engine_name: str) -> None:
    engine = ENGINES[engine_name]()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    assert engine.unwrap(nn.DataParallel(model)) is model
    assert engine.unwrap(torch.compile(nn.DataParallel(model), backend="eager")) is model
    model.cpu()  # DataParallel moves the module to cuda:0 where a GPU exists
    adapter = LinearAdapter("0", model[0])
    assert engine.read(adapter) is None
    marks = GradientMarks()
    marks.record(engine.gradient_marks([adapter]))
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    assert not marks.unchanged(engine.gradient_marks([adapter]))
    raw = engine.read(adapter)
    assert raw is not None and torch.equal(raw, grad_matrix(model[0]))
    engine.write(adapter, raw.clone())
    assert torch.equal(grad_matrix(model[0]), raw)
    new = torch.randn_like(raw)
    engine.write(adapter, new)
    assert torch.equal(engine.read(adapter), new)
    marks.record(engine.gradient_marks([adapter]))
    assert marks.unchanged(engine.gradient_marks([adapter]))


def test_engines_opt_into_exactly_their_capabilities() -> None:
    """The step asks ``isinstance(engine, Protocol)``: the required interface
    has none of a capability's methods (else every engine would claim it),
    and each engine offers exactly the capabilities it has."""
    from kaisa.engines.deepspeed import DeepSpeedEngine
    from kaisa.engines.fsdp import FSDP2Engine
    from kaisa.engines.pipelining import PipeliningEngine
    from kaisa.engines.tensor_parallel.engine import TensorParallelEngine

    protocols = (InPlaceGradients, ShardedReads, ModelParallelLayers, OwnsTheLoop)
    expected = {
        Engine: set(),
        TorchEngine: {InPlaceGradients},
        FSDP2Engine: {ShardedReads},
        DeepSpeedEngine: {ShardedReads, OwnsTheLoop},
        PipeliningEngine: {ShardedReads, OwnsTheLoop},
        # local shards: the in-place path it inherits answers "no layer"
        TensorParallelEngine: {InPlaceGradients, ShardedReads, ModelParallelLayers},
    }
    for cls, capabilities in expected.items():
        assert {p for p in protocols if issubclass(cls, p)} == capabilities, cls.__name__


# -- where K-FAC is exact ------------------------------------------------------------------------


def test_one_datum_kfac_equals_exact_fisher_block() -> None:
    """With one datum a layer's Fisher block is ``(a aᵀ) ⊗ (g gᵀ)`` exactly, so the
    preconditioned gradient must equal the dense solve with the per-example
    gradient's outer product, formed from autograd's weight gradient alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(3, 2)).double()
    # the exact damped solve is the eigen method's (the inverse method's π-split approximates it)
    precond = KFACPreconditioner(
        model, kl_clip=None, damping=DAMPING, factor_decay=0.5, compute_method="eigen"
    )
    x = torch.randn(1, 4, dtype=torch.float64)
    y = torch.randn(1, 2, dtype=torch.float64)
    F.mse_loss(model(x), y, reduction="sum").mul(0.5).backward()
    raw = {name: grad_matrix(model[int(name)]).clone() for name in precond.layers}
    precond.step()
    for name, g in raw.items():
        v = vec(g)
        exact = torch.outer(v, v) + DAMPING * torch.eye(v.numel(), dtype=v.dtype)
        expected = unvec(torch.linalg.solve(exact, v), *g.shape)
        assert rel_err(grad_matrix(model[int(name)]), expected) <= TOL


# -- a layer type with a diagonal factor --------------------------------------------------------


class DiagonalInputLinear(nn.Linear):
    """A Linear whose input factor is kept diagonal (a test-only layer type)."""


class DiagonalInputAdapter(LinearAdapter):
    def factor_specs(self) -> tuple[FactorSpec, ...]:
        return (
            FactorSpec("A", FactorKind.DIAGONAL, self.a_dim, 1, FactorSource.INPUT),
            FactorSpec("G", FactorKind.DENSE, self.g_dim, 0, FactorSource.OUTPUT_GRAD),
        )


@pytest.fixture
def diagonal_layer_type():
    register_layer_type(DiagonalInputLinear, DiagonalInputAdapter)
    yield
    _ADAPTERS.pop(DiagonalInputLinear)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_diagonal_factor_end_to_end(diagonal_layer_type, method: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(DiagonalInputLinear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    precond = KFACPreconditioner(model, kl_clip=None, damping=DAMPING, compute_method=method)
    x = torch.randn(8, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    store = {}
    h = model[0].register_forward_hook(lambda m, i, o: store.update(x=i[0].detach(), z=o))
    out = model(x)
    h.remove()
    store["z"].retain_grad()
    F.cross_entropy(out, y).backward()
    dz = store["z"].grad
    raw = grad_matrix(model[0]).clone()
    precond.step()
    a = torch.cat([store["x"], torch.ones(8, 1, dtype=torch.float64)], dim=1)
    A = (a * a).mean(0)
    G = (dz * 8).t() @ (dz * 8) / 8
    layer = precond.layers["0"]
    assert layer.factor("A").shape == (7,)
    assert rel_err(layer.factor("A"), A) <= TOL and rel_err(layer.factor("G"), G) <= TOL
    specs = layer.factors
    expected = reference(specs, [A, G], raw, method)
    assert rel_err(grad_matrix(model[0]), expected) <= TOL
    state = precond.state_dict(include_second_order=True)
    assert state["layers"]["0"]["A"].shape == (7,)
    fresh = KFACPreconditioner(
        nn.Sequential(DiagonalInputLinear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double(),
        compute_method=method,
    )
    fresh.load_state_dict(state)
    assert torch.equal(fresh.layers["0"].factor("A"), layer.factor("A"))
    assert math.isclose(
        precond.plan.layer("0").factors[0].cost(precond.plan.assignment_strategy), 7
    )
