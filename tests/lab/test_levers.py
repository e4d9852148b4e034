"""The levers under measurement (kaisa_lab.levers): each against its
definition, and carried by a case's arm into its runs and their records."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa_lab.bench.cases import Arm, get_case
from kaisa_lab.levers import PowerEigen, mc_fisher_backward

DAMPING = 0.05


def _layer() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    x = torch.randn(16, 4, dtype=torch.float64)
    return net, x, torch.randint(0, 3, (16,))


def _preconditioned(p: float | None) -> tuple[torch.Tensor, torch.Tensor, KFACPreconditioner]:
    """One step (factors and inverses at once, no KL clip, float64 throughout):
    the gradient before and after, as one matrix [∇W | ∇b]."""
    net, x, y = _layer()
    method = PowerEigen(p) if p is not None else "eigen"
    precond = KFACPreconditioner(
        net,
        method=method,
        damping=DAMPING,
        kl_clip=None,
        lr=0.1,
        inv_dtype=torch.float64,
        factor_dtype=torch.float64,
        factor_compute_dtype=torch.float64,
        precondition_dtype=torch.float64,
    )
    F.cross_entropy(net(x), y).backward()
    raw = torch.cat([net.weight.grad, net.bias.grad[:, None]], 1).clone()
    precond.step()
    return raw, torch.cat([net.weight.grad, net.bias.grad[:, None]], 1), precond


@pytest.mark.parametrize("p", [1.0, 0.5, 0.25])
def test_a_partial_power_is_the_damped_kronecker_factors_power(p: float) -> None:
    """(G ⊗ A + γI)^-p vec(∇), with the dense Kronecker product in float64."""
    raw, got, precond = _preconditioned(p)
    layer = next(iter(precond.layers.values()))
    a, g = layer.factor("A"), layer.factor("G")
    assert a is not None and g is not None
    lam, q = torch.linalg.eigh(
        torch.kron(g, a) + DAMPING * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
    )
    want = (q @ torch.diag(lam.pow(-p)) @ q.T @ raw.reshape(-1)).reshape(raw.shape)
    assert float((got - want).norm() / want.norm()) <= 1e-10


def test_the_full_power_is_kaisas_eigen_method() -> None:
    _, full, _ = _preconditioned(1.0)
    _, eigen, _ = _preconditioned(None)
    assert float((full - eigen).norm() / eigen.norm()) <= 1e-12


def test_a_power_outside_the_unit_interval_is_refused() -> None:
    for p in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"eigen_power must be in \(0, 1\]"):
            PowerEigen(p)


def test_the_monte_carlo_fisher_captures_g_from_sampled_labels_and_keeps_the_true_gradient() -> (
    None
):
    """G: that of a plain backward against the same sampled labels; .grad:
    that of the true labels."""
    net, x, y = _layer()
    twin, plain = copy.deepcopy(net), copy.deepcopy(net)
    precond = KFACPreconditioner(net, damping=DAMPING, lr=0.1)
    assert precond.factor_step
    out = net(x)  # what the sampled labels are drawn from (the same forward)
    loss = mc_fisher_backward(
        net, x, y, F.cross_entropy, precond.paused, torch.Generator().manual_seed(3)
    )
    F.cross_entropy(plain(x), y).backward()
    assert torch.equal(loss, F.cross_entropy(plain(x), y))
    assert torch.equal(net.weight.grad, plain.weight.grad)
    sampled = torch.multinomial(
        out.detach().float().softmax(-1), 1, generator=torch.Generator().manual_seed(3)
    ).reshape(y.shape)
    reference = KFACPreconditioner(twin, damping=DAMPING, lr=0.1)
    F.cross_entropy(twin(x), sampled).backward()
    precond.step()
    reference.step()
    got, want = (next(iter(p.layers.values())).factor("G") for p in (precond, reference))
    assert got is not None and want is not None and not torch.equal(sampled, y)
    assert torch.equal(got, want)


def test_factor_step_says_which_step_is_captured() -> None:
    net, x, y = _layer()
    precond = KFACPreconditioner(net, damping=DAMPING, lr=0.1, factor_update_steps=2)
    seen = []
    for _ in range(4):
        seen.append(precond.factor_step)
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        precond.step()
    assert seen == [True, False, True, False]


def test_an_arms_lever_reaches_its_runs_and_their_records() -> None:
    case = get_case("text-lm-levers")
    arm = case.arm("muon+kfac-p0.5")
    spec = case.spec(arm, case.grid(arm)[0], 0)
    assert spec.eigen_power == 0.5 and spec.to_dict()["eigen_power"] == 0.5
    mc = case.spec(case.arm("sgd+kfac-mc"), case.grid(arm)[0], 0)
    assert mc.fisher == "mc" and mc.to_dict()["fisher"] == "mc"
    plain = case.spec(case.arm("muon+kfac"), case.grid(arm)[0], 0)
    assert {"eigen_power", "fisher", "muon_ns_steps"}.isdisjoint(plain.to_dict())
    with pytest.raises(ValueError, match="unknown lever field"):
        Arm("sgd", kfac=True, lever=(("damping", 1.0),), tag="d")
    with pytest.raises(ValueError, match="names it by a tag"):
        Arm("sgd", kfac=True, lever=(("fisher", "mc"),))


def test_the_monte_carlo_fisher_without_kfac_is_refused() -> None:
    from kaisa_lab.cli.distributed import DistContext
    from kaisa_lab.cli.trainer import Trainer
    from kaisa_lab.tasks.registry import get_task

    case = get_case("quick")
    spec = case.spec(case.arm("sgd"), case.grid(case.arm("sgd"))[0], 0)
    ctx = DistContext(device=torch.device("cpu"))
    for fisher in ("mc", "type-2"):
        bad = dataclasses.replace(spec, fisher=fisher)
        with pytest.raises(ValueError, match=r"one of \('empirical', 'mc'\)"):
            Trainer(bad, get_task(spec.task), ctx)


def test_a_position_fraction_reaches_the_preconditioner_seeded_by_the_run() -> None:
    """The lever is the library's ``factor_position_fraction`` (tested against
    its definition in tests/unit/layers/test_positions.py), its draws seeded
    per run, so that held-out seeds draw their own positions."""
    from kaisa_lab.cli.distributed import DistContext
    from kaisa_lab.cli.trainer import Trainer
    from kaisa_lab.tasks.registry import get_task

    case = get_case("text-lm-levers")
    arm = case.arm("muon+kfac-pos0.125")
    ctx = DistContext(device=torch.device("cpu"))
    seeds = []
    for seed in (0, 5):
        spec = case.spec(arm, case.grid(arm)[0], seed)
        assert spec.to_dict()["position_fraction"] == 0.125
        with Trainer(spec, get_task(spec.task), ctx) as trainer:
            assert trainer.preconditioner is not None
            config = trainer.preconditioner.config
            assert config.factor_position_fraction == 0.125
            seeds.append(config.factor_position_seed)
    assert seeds[0] != seeds[1]
    alone = dataclasses.replace(
        case.spec(case.arm("muon"), case.grid(arm)[0], 0), position_fraction=0.5
    )
    with pytest.raises(ValueError, match="position_fraction: a K-FAC run's option"):
        Trainer(alone, get_task(spec.task), ctx)


def test_kfac_on_muons_adamw_part_registers_the_embeddings_and_head_only() -> None:
    """Every layer owning a parameter Muon steps is left to Muon (the packed
    attention's q/k/v rows included); the rest are K-FAC's."""
    from kaisa_lab.cli.distributed import DistContext
    from kaisa_lab.cli.trainer import Trainer
    from kaisa_lab.tasks.registry import get_task

    case = get_case("text-lm-levers")
    arm = case.arm("muon+kfac-adamw-part")
    spec = case.spec(arm, case.grid(arm)[0], 0)
    assert spec.to_dict()["kfac_layers"] == "adamw-part"
    ctx = DistContext(device=torch.device("cpu"))
    with Trainer(spec, get_task(spec.task), ctx) as trainer:
        registered = set(trainer.preconditioner.layers)
        owners = {name.rpartition(".")[0] for name in trainer.optimizer.split.muon}
    with Trainer(
        case.spec(case.arm("muon+kfac"), case.grid(arm)[0], 0), get_task(spec.task), ctx
    ) as full:
        everything = set(full.preconditioner.layers)
    left = everything - registered
    assert registered == {"tok", "pos", "head"}
    assert {n.removesuffix(".q").removesuffix(".k").removesuffix(".v") for n in left} == owners
    adamw = dataclasses.replace(spec, optimizer="adamw", adamw_lr=None, adamw_weight_decay=None)
    with pytest.raises(ValueError, match="'adamw-part' under muon with K-FAC only"):
        Trainer(adamw, get_task(spec.task), ctx)
    alone = dataclasses.replace(spec, kfac=False, kfac_kwargs={})
    with pytest.raises(ValueError, match="'adamw-part' under muon with K-FAC only"):
        Trainer(alone, get_task(spec.task), ctx)


def test_a_kfac_keyword_lever_reaches_the_preconditioners_keywords_and_the_record() -> None:
    case = get_case("text-lm-levers")
    arm = case.arm("sgd+kfac-clip0.1")
    spec = case.spec(arm, case.grid(arm)[0], 0)
    assert spec.kfac_kwargs["kl_clip"] == 0.1 and spec.to_dict()["kfac"]["kl_clip"] == 0.1
    bf16 = case.spec(case.arm("muon+kfac-block129-pos0.125-bf16"), case.grid(arm)[0], 0)
    assert bf16.kfac_config().factor_compute_dtype is torch.bfloat16
    plain = case.spec(case.arm("sgd+kfac"), case.grid(arm)[0], 0)
    assert plain.to_dict()["kfac"]["kl_clip"] == 0.001  # kfac-pytorch's, the library default
    with pytest.raises(ValueError, match=r"unknown lever field\(s\) \['kfac.kl_clipp'\]"):
        Arm("sgd", kfac=True, lever=(("kfac.kl_clipp", 0.1),), tag="c")
    with pytest.raises(ValueError, match="a K-FAC keyword lever needs K-FAC"):
        Arm("sgd", lever=(("kfac.kl_clip", 0.1),), tag="c")
