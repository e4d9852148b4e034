"""The preconditioner's API: registration, hooks, errors, state, failures."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa import KFACPreconditioner
from kaisa.core.decompose import DecompositionError
from kfac_defaults import kfac_pytorch

from kfac_reference import rel_err


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, padding=1, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
    )


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(model, precond, opt, steps: int, seed0: int = 0) -> list[float]:
    losses = []
    for i in range(steps):
        x, y = batch(seed=seed0 + i)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        precond.step()
        opt.step()
        losses.append(loss.item())
    return losses


# -- registration ----------------------------------------------------------------


def test_registration_report_names_what_is_left_to_the_optimizer() -> None:
    model = small_cnn()
    with pytest.warns(UserWarning, match=r"not preconditioning '3'.*groups=2"):
        precond = KFACPreconditioner(model)
    assert list(precond.layers) == ["0", "5"]
    reasons = {s.name: s.reason for s in precond.skipped}
    assert "groups=2" in reasons["3"]
    assert "BatchNorm2d" in reasons["1"]
    report = precond.describe()
    assert "Left to the optimizer" in report and "3.weight" in report and "1.bias" in report
    assert "KFACPreconditioner(layers=2" in repr(precond)


def test_skip_layers_by_name_and_class_frozen_layers_registered() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Conv2d(1, 1, 1), nn.Linear(4, 2))
    model[3].weight.requires_grad_(False)
    precond = KFACPreconditioner(model, skip_layers=["^1$", "Conv2d"])
    # a frozen layer is registered: it is preconditioned once it is unfrozen
    assert list(precond.layers) == ["0", "3"]
    reasons = {s.name: s.reason for s in precond.skipped}
    assert "skip_layers" in reasons["1"] and "skip_layers" in reasons["2"]
    assert set(reasons) == {"1", "2"}


def test_model_without_supported_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no layer K-FAC can precondition.*BatchNorm1d"):
        KFACPreconditioner(nn.Sequential(nn.BatchNorm1d(3)))


# -- input validation ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(damping=0.0), ValueError, r"damping must be in \(0"),
        (dict(damping=-1.0), ValueError, "damping"),
        (dict(factor_decay=0.0), ValueError, r"factor_decay must be in \(0.0, 1.0\]"),
        (dict(factor_decay=1.5), ValueError, "factor_decay"),
        (dict(inv_update_steps=0), ValueError, "inv_update_steps"),
        (dict(inv_update_steps=2.5), TypeError, "inv_update_steps must be an int"),
        (dict(factor_update_steps=True), TypeError, "factor_update_steps"),
        (
            dict(compute_method="cholesky"),
            ValueError,
            "compute_method must be one of 'eigen', 'inverse'",
        ),
        (dict(assignment_strategy="speed"), ValueError, "assignment_strategy"),
        (dict(loss_average="tokens"), ValueError, "loss_average"),
        (dict(kl_clip=0.0), ValueError, "kl_clip"),
        (dict(lr=-0.1), ValueError, "lr"),
        (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
        (dict(grad_worker_fraction=1.5), ValueError, "grad_worker_fraction"),
        (dict(grad_worker_fraction="some-opt"), ValueError, "grad_worker_fraction"),
        (dict(allreduce_bucket_cap_mb=-1), ValueError, "allreduce_bucket_cap_mb"),
        (dict(inv_dtype=torch.float16), ValueError, "inv_dtype"),
        (dict(factor_dtype=torch.int32), ValueError, "factor_dtype"),
        (dict(symmetry_aware="yes"), TypeError, "symmetry_aware"),
        (dict(skip_layers=[1]), TypeError, "skip_layers"),
        (
            dict(dampning=0.1),
            TypeError,
            r"unknown option\(s\) 'dampning' \(did you mean 'damping'\?\)",
        ),
        (dict(pg_timeout_s=0), ValueError, "pg_timeout_s"),
        (dict(optimizer="sgd"), TypeError, "optimizer"),
    ],
)
def test_bad_input_names_the_argument(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        KFACPreconditioner(mlp(), **kwargs)


def test_callable_hyperparameter_is_checked_when_evaluated() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, damping=lambda step: -1.0)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"damping\(0\)"):
        precond.step()


def test_step_before_backward_is_a_clear_error() -> None:
    precond = KFACPreconditioner(mlp())
    with pytest.raises(RuntimeError, match="before any forward/backward"):
        precond.step()


def test_string_forms_are_accepted() -> None:
    p = KFACPreconditioner(
        mlp(),
        compute_method="INVERSE",
        factor_dtype="float64",
        grad_worker_fraction="mem-opt",
        skip_layers="nothing",
    )
    assert p.config.compute_method is kaisa.ComputeMethod.INVERSE
    assert p.config.factor_dtype is torch.float64
    assert p.config.grad_worker_fraction is kaisa.DistributedStrategy.MEM_OPT


# -- hooks -----------------------------------------------------------------------------


def test_eval_mode_and_no_grad_capture_nothing() -> None:
    model = mlp()
    precond = KFACPreconditioner(model)
    x, _ = batch()
    model.eval()
    model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert all(la.batch.pending_forwards == 0 for la in precond.layers.values())
    model(x)  # a training-mode forward waits for its gradient
    assert all(la.batch.pending_forwards == 1 for la in precond.layers.values())


def test_remove_hooks_and_context_manager() -> None:
    model = mlp()
    with KFACPreconditioner(model) as precond:
        model(batch()[0])
        assert precond.layers["0"].batch.pending_forwards == 1
    model(batch()[0])
    assert precond.layers["0"].batch.pending_forwards == 1
    assert not model[0]._forward_hooks and not model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="remove_hooks"):
        precond.step()


def test_capture_only_on_factor_update_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, factor_update_steps=3, inv_update_steps=3)
    calls = []
    for i in range(6):
        x, y = batch(seed=i)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        calls.append(precond.layers["0"].batch.calls)
        precond.step()
        opt.step()
    assert calls == [1, 0, 0, 1, 0, 0]


def test_inv_update_steps_not_multiple_warns() -> None:
    with pytest.warns(UserWarning, match="not a multiple"):
        KFACPreconditioner(mlp(), factor_update_steps=2, inv_update_steps=3)


# -- lr sources ---------------------------------------------------------------------------


def test_lr_from_optimizer_and_callable() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert KFACPreconditioner(model, optimizer=opt).lr == 0.05
    opt.param_groups[0]["lr"] = 0.01
    p = KFACPreconditioner(model, optimizer=opt)
    assert p.lr == 0.01
    assert KFACPreconditioner(model, optimizer=opt, lr=0.3).lr == 0.3
    assert KFACPreconditioner(model, lr=lambda s: 0.5 / (s + 1)).lr == 0.5


def test_kl_clip_uses_current_optimizer_lr() -> None:
    # The same gradients with a 10x larger optimizer lr must be clipped 10x harder.
    x, y = batch()
    results = []
    for lr in (0.01, 0.1):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        precond = KFACPreconditioner(model, optimizer=opt, kl_clip=1e-8)
        F.cross_entropy(model(x), y).backward()
        precond.step()
        results.append(model[0].weight.grad.clone())
    assert rel_err(results[0], 10 * results[1]) < 1e-5


# -- training ----------------------------------------------------------------------------------


def test_kfac_reduces_loss_faster_than_sgd_on_a_fixed_problem() -> None:
    torch.manual_seed(0)
    x, y = batch(64, seed=42)

    def run(kfac: bool) -> float:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = (
            KFACPreconditioner(model, optimizer=opt, **kfac_pytorch(damping=0.01)) if kfac else None
        )
        for _ in range(30):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if precond:
                precond.step()
            opt.step()
        return F.cross_entropy(model(x), y).item()

    assert run(True) < 0.8 * run(False)


def test_kfac_pytorch_values_are_passed_through_one_helper() -> None:
    """tests/kfac_defaults.kfac_pytorch gives kfac-pytorch's values, the
    shipped defaults stay kaisa's: what a test means by the former it says."""
    shipped = kaisa.KFACConfig()
    assert all(getattr(shipped, k) != v for k, v in kaisa.KFAC_PYTORCH_DEFAULTS.items())
    config = kaisa.KFACConfig(**kfac_pytorch())
    assert (config.factor_update_steps, config.inv_update_steps, config.damping) == (1, 1, 0.001)
    assert kaisa.ComputeMethod(config.compute_method) is kaisa.ComputeMethod.EIGEN


# -- state -------------------------------------------------------------------------------------


@pytest.mark.parametrize("second_order", [False, True])
def test_state_dict_resume_equals_uninterrupted(second_order: bool) -> None:
    kwargs = dict(factor_update_steps=1, inv_update_steps=3 if second_order else 1, damping=0.01)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, **kwargs)
    train(model, precond, opt, 4)
    state = precond.state_dict(include_second_order=second_order)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, precond, opt, 3, seed0=4)

    model2 = mlp()
    model2.load_state_dict(saved_model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved_opt)
    precond2 = KFACPreconditioner(model2, optimizer=opt2, **kwargs)
    precond2.load_state_dict(state)
    assert precond2.steps == 4
    train(model2, precond2, opt2, 3, seed0=4)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_state_dict_contents_and_validation() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, **kfac_pytorch(damping=lambda s: 0.01))
    assert precond.state_dict()["layers"] == {"0": {}, "2": {}}  # nothing captured yet
    train(model, precond, opt, 1)
    # the default holds what an exact resume needs: the factors and the second order
    assert set(precond.state_dict()["layers"]["0"]) == {"A", "G", "qa", "qg", "inv_outer"}
    state = precond.state_dict(include_second_order=False)
    assert set(state["layers"]["0"]) == {"A", "G"}
    assert state["layers"]["0"]["A"].shape == (7, 7)
    assert "damping" not in state["hyperparameters"]  # callables are not saved
    assert state["hyperparameters"]["compute_method"] == "eigen"
    assert "layers" not in precond.state_dict(include_factors=False)
    bad = copy.deepcopy(state)
    bad["layers"]["0"]["A"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"0\.A has shape"):
        precond.load_state_dict(bad)
    with pytest.raises(ValueError, match="missing"):
        precond.load_state_dict({"steps": 1, "layers": {"0": {}}})


def test_memory_usage_counts_factors_and_second_order() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, **kfac_pytorch(compute_eigenvalue_outer_product=True)
    )
    assert precond.memory_usage()["total"] == 0
    train(model, precond, opt, 1)
    mem = precond.memory_usage()
    f = 4  # float32
    assert mem["factors"] == f * (7 * 7 + 8 * 8 + 9 * 9 + 3 * 3)
    # Q_A, Q_G and the eigenvalue outer product per layer
    assert mem["second_order"] == f * (7 * 7 + 8 * 8 + 8 * 7 + 9 * 9 + 3 * 3 + 3 * 9)
    assert mem["workspace"] == 0  # layers this small allocate (tests/unit/core/test_workspace.py)
    assert mem["stacked"] == 0  # no two layers of one shape
    parts = ("factors", "second_order", "batch_statistics", "workspace", "stacked")
    assert mem["total"] == sum(mem[k] for k in parts)


@pytest.mark.parametrize("mode", ["block", "diagonal"])
def test_describe_and_memory_usage_report_large_factors(mode: str) -> None:
    """Above max_factor_dim=4 the factors of sizes 7, 8 and 9 are kept
    block-diagonal (blocks 4+3, 4+4, 3+3+3: Σ b² entries) or diagonal; the
    report names each and memory_usage counts what is held, not d²."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        **kfac_pytorch(compute_eigenvalue_outer_product=True, max_factor_dim=4, large_factor=mode),
    )
    report = precond.describe()
    train(model, precond, opt, 1)
    mem = precond.memory_usage()
    f = 4  # float32
    outer = 8 * 7 + 3 * 9
    if mode == "block":
        assert "Linear(A: block-diagonal 1×4+1×3, G: block-diagonal 2×4)" in report
        assert "Linear(A: block-diagonal 3×3, G: 3×3)" in report
        assert (
            "not kept dense: 0.A (7 block-diagonal 1×4+1×3), 0.G (8 block-diagonal 2×4), "
            "2.A (9 block-diagonal 3×3)" in report
        )
        kept = (16 + 9) + (16 + 16) + (9 + 9 + 9) + 3 * 3
        assert mem["factors"] == f * kept
        # the blocks' eigenbases, flat like the factors, and the outer products
        assert mem["second_order"] == f * (kept + outer)
    else:
        assert "Linear(A: 7 diagonal, G: 8 diagonal)" in report
        assert "Linear(A: 9 diagonal, G: 3×3)" in report
        assert (
            "max_factor_dim=4, not kept dense: 0.A (7 diagonal), 0.G (8 diagonal), "
            "2.A (9 diagonal)" in report
        )
        assert mem["factors"] == f * (7 + 8 + 9 + 3 * 3)
        assert mem["second_order"] == f * (3 * 3 + outer)  # a diagonal's basis is I
    unlimited = KFACPreconditioner(mlp(), max_factor_dim=None).describe()
    assert "not kept dense" not in unlimited and "Linear(A: 7×7, G: 8×8)" in unlimited


# -- numerical failures ---------------------------------------------------------------------------


def test_non_finite_backward_does_not_poison_factors() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, **kfac_pytorch())
    train(model, precond, opt, 2)
    before = {n: la.factor("G").clone() for n, la in precond.layers.items()}
    x, y = batch(seed=9)
    opt.zero_grad()
    (F.cross_entropy(model(x), y) * float("inf")).backward()
    with pytest.warns(UserWarning, match="non-finite gradients"):
        precond.step()  # must not raise: the step is skipped (test_safety.py)
    for n, la in precond.layers.items():
        assert torch.equal(la.factor("G"), before[n])
        assert torch.isfinite(la.state["qg"]).all()
    assert precond.nonfinite_steps == 1
    opt.zero_grad()  # the next healthy step trains normally
    losses = train(model, precond, opt, 3, seed0=10)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.isfinite(p).all() for p in model.parameters() if p.grad is not None)


def test_failed_decomposition_keeps_previous(monkeypatch) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, **kfac_pytorch())
    train(model, precond, opt, 1)
    kept = {k: v.clone() for k, v in precond.layers["0"].state.items()}

    def broken(*args, **kwargs):
        raise DecompositionError("simulated")

    monkeypatch.setattr("kaisa.methods.eigen.symmetric_eigh", broken)
    train(model, precond, opt, 1, seed0=1)
    assert precond.layers["0"].failed_decompositions == 1
    for k, v in kept.items():
        assert torch.equal(precond.layers["0"].state[k], v)


def test_eigh_that_does_not_converge_is_retried_in_float64(monkeypatch) -> None:
    from kaisa.core import decompose

    real = torch.linalg.eigh
    calls = []

    def flaky(m, *a, **k):
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("simulated")
        return real(m, *a, **k)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    q, lam = decompose.symmetric_eigh(torch.eye(3) * 2, torch.float32)
    assert calls == [torch.float32, torch.float64]
    assert q.dtype == torch.float32 and torch.allclose(lam, torch.full((3,), 2.0))


def test_first_decomposition_failure_falls_back_to_damping_only(monkeypatch) -> None:
    model = mlp()
    precond = KFACPreconditioner(model, **kfac_pytorch(kl_clip=None, damping=0.5))

    def broken(*args, **kwargs):
        raise DecompositionError("simulated")

    monkeypatch.setattr("kaisa.methods.eigen.symmetric_eigh", broken)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    raw = model[0].weight.grad.clone()
    precond.step()
    assert torch.allclose(model[0].weight.grad, raw / 0.5)


# -- precision -----------------------------------------------------------------------------------


def _one_step_factors(scaler=None, autocast_dtype=None):
    model = mlp()
    precond = KFACPreconditioner(model, grad_scaler=scaler, kl_clip=None)
    x, y = batch(32)
    ctx = (
        torch.autocast("cpu", dtype=autocast_dtype)
        if autocast_dtype is not None
        else torch.autocast("cpu", enabled=False)
    )
    with ctx:
        loss = F.cross_entropy(model(x), y)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    precond.step()
    return precond


def test_grad_scaler_scale_is_divided_out_of_g() -> None:
    plain = _one_step_factors()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaled = _one_step_factors(scaler=scaler)
    for name in plain.layers:
        g_plain, g_scaled = plain.layers[name].factor("G"), scaled.layers[name].factor("G")
        assert rel_err(g_scaled, g_plain) < 1e-5  # without the division: 2**20 times larger


def test_autocast_bf16_capture_gives_float32_factors() -> None:
    plain = _one_step_factors()
    half = _one_step_factors(autocast_dtype=torch.bfloat16)
    for name in plain.layers:
        for key in ("A", "G"):
            got = half.layers[name].factor(key)
            assert got.dtype == torch.float32
            assert torch.isfinite(got).all()
            assert rel_err(got, plain.layers[name].factor(key)) < 5e-2


def test_load_state_dict_restores_schedule_hyperparameters_not_structure() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = KFACPreconditioner(model, lr=0.2, damping=0.05, inv_update_steps=4)
    train(model, source, opt, 1)
    target = KFACPreconditioner(
        mlp(),
        damping=0.001,
        inv_update_steps=2,
        factor_decay=lambda s: 0.9,
        compute_method="inverse",
    )
    target.load_state_dict(source.state_dict())
    assert target.config.damping == 0.05
    assert target.config.inv_update_steps == 4
    assert callable(target.config.factor_decay)  # a callable is never replaced
    assert target.config.compute_method is kaisa.ComputeMethod.INVERSE
    assert target.config.lr == 0.2
    # an lr read from an optimizer is never overridden by the checkpoint
    model = mlp()
    follower = KFACPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.07))
    follower.load_state_dict(source.state_dict())
    assert follower.lr == 0.07


def test_an_lr_read_from_the_optimizer_is_not_saved_as_the_preconditioners() -> None:
    """A preconditioner following its optimizer's lr has none of its own to
    save: a checkpoint that held the config's default would, loaded into one
    given ``lr=``, impose a value neither run used."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    follower = KFACPreconditioner(model, optimizer=opt)
    train(model, follower, opt, 1)
    assert "lr" not in follower.state_dict()["hyperparameters"]
    assert "lr" not in follower.sharded_state_dict()["hyperparameters"]
    own = KFACPreconditioner(mlp(), lr=0.5)
    own.load_state_dict(follower.state_dict())
    assert own.lr == 0.5


def test_multihead_attention_is_preconditioned_and_steps() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0].mean(1))

    torch.manual_seed(0)
    model = Block()
    precond = KFACPreconditioner(model)
    assert list(precond.layers) == ["attn.q", "attn.k", "attn.v", "attn.out_proj", "head"]
    x, y = torch.randn(4, 5, 8), torch.randint(0, 3, (4,))
    F.cross_entropy(model(x), y).backward()
    precond.step()  # kfac-pytorch crashes here
    assert all(la.decomposed for la in precond.layers.values())
    # skipped, the attention's out_proj is reported with its parent
    skipping = KFACPreconditioner(model, skip_layers=["MultiheadAttention"])
    assert list(skipping.layers) == ["head"]
    reasons = {s.name: s.reason for s in skipping.skipped}
    assert "skip_layers" in reasons["attn"] and "out_proj" in reasons["attn.out_proj"]


def test_layer_whose_hooks_never_fire_keeps_its_raw_gradient() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(6, 4)
            self.bypassed = nn.Linear(4, 3)

        def forward(self, x):
            h = torch.tanh(self.used(x))
            return F.linear(h, self.bypassed.weight, self.bypassed.bias)  # no module call

    torch.manual_seed(0)
    model = Functional()
    precond = KFACPreconditioner(model, kl_clip=None)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    raw_bypassed = model.bypassed.weight.grad.clone()
    raw_used = model.used.weight.grad.clone()
    with pytest.warns(UserWarning, match="'bypassed' has a gradient but its hooks never captured"):
        precond.step()
    assert torch.equal(model.bypassed.weight.grad, raw_bypassed)
    assert not torch.allclose(model.used.weight.grad, raw_used)  # the other layer is preconditioned


def test_sharded_state_round_trip_and_refusals_in_one_process() -> None:
    """sharded_state_dict() holds every factor and second-order tensor in one
    process; a template with a factor or a second-order tensor missing, or
    mis-shaped, is refused before anything changes."""
    model = mlp()
    precond = KFACPreconditioner(model, damping=0.01)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    precond.step()
    state = precond.sharded_state_dict()
    before = {k: v.clone() for k, v in state["factors"].items()}
    assert set(before) == {f"{n}.{f}" for n in precond.layers for f in ("A", "G")}
    fresh = KFACPreconditioner(mlp(), damping=0.01)
    key = next(iter(before))
    broken = {**state, "factors": {k: v for k, v in state["factors"].items() if k != key}}
    with pytest.raises(ValueError, match="lacks factors"):
        fresh.load_sharded_state_dict(broken)
    bad = {**state, "factors": {**state["factors"], key: torch.zeros(2)}}
    with pytest.raises(ValueError, match="must be a tensor of shape"):
        fresh.load_sharded_state_dict(bad)
    key = next(iter(state["second_order"]))
    no_second = {
        **state,
        "second_order": {k: v for k, v in state["second_order"].items() if k != key},
    }
    with pytest.raises(ValueError, match="lacks second-order tensors this rank works on"):
        fresh.load_sharded_state_dict(no_second)
    factor_key = next(iter(state["factors"]))
    for part, damaged, why in (
        ("factors", torch.full_like(state["factors"][factor_key], float("nan")), "NaN or Inf"),
        ("factors", state["factors"][factor_key].to(torch.int64), "of dtype torch.int64"),
        ("second_order", torch.full_like(state["second_order"][key], float("inf")), "NaN or Inf"),
    ):
        name = factor_key if part == "factors" else key
        with pytest.raises(ValueError, match=f"{name!r}.*{why}"):
            fresh.load_sharded_state_dict({**state, part: {**state[part], name: damaged}})
    assert all(f is None for la in fresh.layers.values() for f in la.running)
    assert all(not la.state for la in fresh.layers.values())
    absent = {**state, "present": {**state["present"], factor_key: torch.tensor(0.0)}}
    absent["factors"] = {
        **state["factors"],
        factor_key: torch.full_like(before[factor_key], float("nan")),
    }
    fresh.load_sharded_state_dict(absent)  # a factor flagged absent is not read, whatever it holds
    layer_name, factor_name = factor_key.rsplit(".", 1)
    assert fresh.layers[layer_name].factor(factor_name) is None
    fresh = KFACPreconditioner(mlp(), damping=0.01)
    fresh.load_sharded_state_dict(state)
    assert fresh.steps == 1
    for name, la in fresh.layers.items():
        for spec in la.factors:
            assert torch.equal(la.factor(spec.name), before[f"{name}.{spec.name}"])
        for key, value in la.state.items():  # the second-order tensors, as saved
            assert torch.equal(value, state["second_order"][f"{name}.{key}"]), (name, key)
        assert la.state and la.decomposed


def test_a_layer_first_captured_late_is_decomposed_at_once() -> None:
    """A layer that takes part only from a later factor step is decomposed at
    that step, not at the next inverse update: the step does not rescan
    settled layers on every step, but a factor step looks again."""

    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.late, self.use_late = nn.Linear(6, 6), nn.Linear(6, 3), False
            self.head = nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.body(x))
            return self.head(h) + (self.late(h) if self.use_late else 0.0)

    torch.manual_seed(0)
    model = Late()
    precond = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=100)
    g = torch.Generator().manual_seed(0)
    for s in range(6):
        model.use_late = s >= 3  # first seen at step 3, captured at the factor step 4
        model.zero_grad()
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        precond.step()
        late = precond.layers["late"]
        assert late.decomposed == (s >= 4), s


def test_a_call_it_cannot_take_says_how_to_fix_it() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"'factor_update_step' \(did you mean 'factor_update_steps'"
    ):
        KFACPreconditioner(model, factor_update_step=5)
    with pytest.raises(TypeError, match=r"pass the optimizer as optimizer=\.\.\."):
        KFACPreconditioner(model, opt)  # type: ignore[misc]
    with pytest.raises(TypeError, match="every option by keyword"):
        KFACPreconditioner(model, 10)  # type: ignore[misc]
    # the signature stays the constructor's for inspect (and IDEs, type checkers)
    params = inspect.signature(KFACPreconditioner).parameters
    assert "factor_update_steps" in params and "args" not in params


def test_the_kl_clips_assumed_lr_is_a_warning_once_per_preconditioner() -> None:
    with pytest.warns(UserWarning, match="the KL clip assumes a learning rate of 0.1"):
        KFACPreconditioner(mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(mlp(), lr=0.1)
        KFACPreconditioner(mlp(), kl_clip=None)
        model = mlp()
        KFACPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_no_layer_error_names_every_supported_type() -> None:
    with pytest.raises(ValueError, match="no layer K-FAC can precondition") as err:
        KFACPreconditioner(nn.Sequential(nn.ReLU()), lr=0.1)
    for name in ("nn.Linear", "nn.Conv1d", "nn.Conv2d", "nn.Embedding", "nn.MultiheadAttention"):
        assert name in str(err.value)


def test_what_kaisa_changes_is_named_once_at_the_users_line() -> None:
    """Supported layers kaisa leaves out of its own accord (tied parameters)
    and factors it does not keep dense (``max_factor_dim``) are named in one
    warning, attributed to the caller's line; a head tied to an embedding
    (its weight preconditioned as the head) and layers the user skipped are
    not changes, and a model with nothing changed warns nothing."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)
            self.b = nn.Linear(6, 6)
            self.b.weight = self.a.weight
            self.head = nn.Linear(6, 40)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        precond = KFACPreconditioner(Tied(), max_factor_dim=32, lr=0.1)
    changes = [w for w in seen if "not preconditioning" in str(w.message)]
    assert len(changes) == 1
    message = str(changes[0].message)
    assert "'a' (Linear): tied parameter" in message and "'b' (Linear)" in message
    assert "head.G (40 diagonal)" in message and "max_factor_dim=32" in message
    assert changes[0].filename == __file__
    assert "head.G" in precond.describe()

    class LanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 6)
            self.mid = nn.Linear(6, 6)
            self.head = nn.Linear(6, 20, bias=False)
            self.head.weight = self.emb.weight

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(LanguageModel(), lr=0.1)
        KFACPreconditioner(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), skip_layers=["1"], lr=0.1
        )


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_second_order_state_without_factors_preconditions_until_the_next_inverse_update(
    method: str,
) -> None:
    """A checkpoint with the second-order state but no factors (or one that
    lacks a layer's factors) restarts the statistics and keeps
    preconditioning with the saved decompositions until the inverse update
    after the next capture: until then every step equals the uninterrupted
    run's, non-factor and factor steps alike (the model is held fixed, so
    only K-FAC's state could differ)."""
    options = dict(
        damping=0.1, lr=0.1, kl_clip=0.01, factor_update_steps=2, inv_update_steps=4,
        compute_method=method,
    )  # fmt: skip

    def grads(precond: KFACPreconditioner, model: nn.Module, steps: range) -> list[torch.Tensor]:
        out = []
        for i in steps:
            model.zero_grad()
            x, y = batch(seed=i)
            F.cross_entropy(model(x), y).backward()
            precond.step()
            out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        return out

    model = mlp()
    whole = KFACPreconditioner(model, **options)
    expected = grads(whole, model, range(8))
    model = mlp()
    first = KFACPreconditioner(model, **options)
    grads(first, model, range(5))
    state = first.state_dict(include_factors=False, include_second_order=True)
    assert all("A" not in entry and entry for entry in state["layers"].values())
    model = mlp()
    resumed = KFACPreconditioner(model, **options)
    resumed.load_state_dict(state)
    got = grads(resumed, model, range(5, 8))  # 5, 7 non-factor; 6 a factor step; 8 inverts
    for step, (g, e) in enumerate(zip(got, expected[5:]), start=5):
        assert torch.equal(g, e), step


def test_setting_lr_to_none_goes_back_to_the_optimizers_learning_rate() -> None:
    """``precond.lr = x`` overrides the optimizer's lr for the KL clip;
    ``precond.lr = None`` reads the optimizer's again (schedules included),
    and the step then clips exactly as a preconditioner that never had one."""

    def clipped_grads(set_and_reset: bool) -> torch.Tensor:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        precond = KFACPreconditioner(model, optimizer=opt, kl_clip=1e-4, damping=0.1)
        if set_and_reset:
            precond.lr = 0.05
            assert precond.lr == 0.05
            precond.lr = None
        opt.param_groups[0]["lr"] = 0.3  # a schedule's change is seen
        assert precond.lr == 0.3
        x, y = batch()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    assert torch.equal(clipped_grads(True), clipped_grads(False))
    reset = KFACPreconditioner(mlp(), optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1))
    reset.lr = 0.05
    assert reset.state_dict()["hyperparameters"]["lr"] == 0.05  # its own: saved
    reset.lr = None
    assert "lr" not in reset.state_dict()["hyperparameters"]  # the optimizer's: not saved
    alone = KFACPreconditioner(mlp(), lr=0.1)
    with pytest.raises(ValueError, match="lr=None reads the optimizer's learning rate"):
        alone.lr = None
    assert alone.lr == 0.1


def test_a_top_level_entry_the_state_does_not_hold_is_named_in_a_warning() -> None:
    """kfac-pytorch keeps its schedule values at the top level of its state;
    a script that edits ``state['damping']`` before loading would otherwise
    be ignored without a word."""
    precond = KFACPreconditioner(mlp(), damping=0.1, lr=0.1)
    state = precond.state_dict()
    state["damping"] = 0.5
    fresh = KFACPreconditioner(mlp(), damping=0.1, lr=0.1)
    with pytest.warns(UserWarning, match=r"ignored: \['damping'\].*\['hyperparameters'\]"):
        fresh.load_state_dict(state)
    assert fresh.damping == 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(precond.state_dict())  # its own keys: nothing to say
