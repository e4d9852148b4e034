"""A kfac-pytorch script that switches only its import: enums, attributes,
schedulers, factor-decay schedules, checkpoints, warnings and logs."""

from __future__ import annotations

import enum
import logging
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa import KFACPreconditioner
from kaisa.compat import is_kfac_pytorch_state, kfac_pytorch_schedule
from kaisa.scheduler import LambdaParamScheduler
from kfac_defaults import kfac_pytorch

from kfac_pytorch_source import import_kfac


# kfac.enums, as a script holds them: other values, same class and member names
class ComputeMethod(enum.Enum):
    EIGEN = 1
    INVERSE = 2


class AssignmentStrategy(enum.Enum):
    COMPUTE = 1
    MEMORY = 2


class DistributedStrategy(enum.Enum):
    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


class AllreduceMethod(enum.Enum):
    ALLREDUCE = 1
    ALLREDUCE_BUCKETED = 2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def step(model: nn.Module, precond: KFACPreconditioner, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    precond.step()


# -- enums ----------------------------------------------------------------------------


def test_kfac_pytorch_enum_members_are_accepted_by_name() -> None:
    p = KFACPreconditioner(
        mlp(),
        compute_method=ComputeMethod.EIGEN,
        assignment_strategy=AssignmentStrategy.MEMORY,
        grad_worker_fraction=DistributedStrategy.COMM_OPT,
    )
    assert p.config.compute_method is kaisa.ComputeMethod.EIGEN
    assert p.config.assignment_strategy is kaisa.AssignmentStrategy.MEMORY
    assert p.config.grad_worker_fraction is kaisa.DistributedStrategy.COMM_OPT
    # and kaisa's members compare equal to them (scripts compare against kfac.enums)
    assert p.compute_method == ComputeMethod.EIGEN and p.compute_method != ComputeMethod.INVERSE
    assert p.assignment_strategy == AssignmentStrategy.MEMORY
    assert p.distributed_strategy == DistributedStrategy.COMM_OPT
    assert p.allreduce_method == AllreduceMethod.ALLREDUCE_BUCKETED
    # kaisa's own comparisons are unchanged
    assert p.compute_method == "eigen" and {p.compute_method: 1}[kaisa.ComputeMethod.EIGEN] == 1


def test_a_foreign_member_kaisa_does_not_have_is_refused_by_name() -> None:
    class Other(enum.Enum):
        CHOLESKY = 1

    with pytest.raises(ValueError, match=r"compute_method must be one of 'eigen', 'inverse'"):
        KFACPreconditioner(mlp(), compute_method=Other.CHOLESKY)
    with pytest.raises(ValueError, match="grad_worker_fraction must be one of"):
        KFACPreconditioner(mlp(), grad_worker_fraction=Other.CHOLESKY)


# -- attributes -----------------------------------------------------------------------


def test_compute_method_names_the_method_object_that_runs() -> None:
    """``method=`` an object: the attribute, ``repr`` and the checkpoint's
    hyperparameters name that method, not the default ``compute_method``."""
    from kaisa.methods.ekfac_adam import EKFACAdamMethod
    from kaisa.methods.inverse import InverseMethod

    p = KFACPreconditioner(mlp(), method=EKFACAdamMethod(eps=1e-3), grafting="sgd")
    assert p.compute_method is kaisa.ComputeMethod.EKFAC_ADAM
    assert p.state_dict()["hyperparameters"]["compute_method"] == "ekfac_adam"
    assert "compute_method=ekfac_adam" in repr(p)

    class Mine(InverseMethod):
        name = "mine"

    assert KFACPreconditioner(mlp(), method=Mine()).compute_method == "mine"


def test_configuration_attributes_read_as_kfac_pytorch_exposes_them() -> None:
    p = KFACPreconditioner(
        mlp(),
        factor_update_steps=3,
        inv_update_steps=9,
        compute_method="inverse",
        colocate_factors=False,
        symmetry_aware=True,
        allreduce_bucket_cap_mb=0,
        skip_layers="nothing",
        factor_dtype=torch.float64,
    )
    assert (p.factor_update_steps, p.inv_update_steps) == (3, 9)
    assert p.compute_method is kaisa.ComputeMethod.INVERSE
    assert p.grad_worker_fraction == 1.0 and isinstance(p.grad_worker_fraction, float)
    assert p.distributed_strategy is kaisa.DistributedStrategy.COMM_OPT
    assert p.colocate_factors is False and p.symmetry_aware is True
    assert p.allreduce_bucket_cap_mb == 0 and p.allreduce_method is kaisa.AllreduceMethod.ALLREDUCE
    assert p.assignment_strategy is kaisa.AssignmentStrategy.COMPUTE
    assert p.skip_layers == ["nothing"] and p.factor_dtype is torch.float64
    assert p.accumulation_steps == 1 and p.update_factors_in_hook is True
    assert p.compute_eigenvalue_outer_product is True


def test_hyperparameters_are_settable_and_validated_at_once() -> None:
    model = mlp()
    p = KFACPreconditioner(model, damping=0.01, inv_update_steps=4)
    p.damping = 0.05
    p.inv_update_steps = 2
    p.kl_clip = None
    assert (p.damping, p.inv_update_steps, p.kl_clip) == (0.05, 2, None)
    assert p.config.damping == 0.05  # the config view follows
    with pytest.raises(ValueError, match=r"damping must be in \(0"):
        p.damping = 0.0
    with pytest.raises(TypeError, match="factor_update_steps must be an int"):
        p.factor_update_steps = 2.5
    p.lr = lambda s: 0.5 / (s + 1)  # a callable of the step, as kfac-pytorch allows
    assert p.lr == 0.5
    step(model, p)
    assert p.lr == 0.25


def test_private_names_are_kfac_pytorchs_unvalidated_until_used() -> None:
    model = mlp()
    p = KFACPreconditioner(model, damping=0.01, factor_decay=lambda s: 0.9)
    assert p._damping == 0.01 and callable(p._factor_decay)
    p._damping = 0.0  # what kfac-pytorch's scheduler may write
    assert p.damping == 0.0  # read back as set
    with pytest.raises(ValueError, match=r"damping must be in \(0"):
        step(model, p)  # refused where it is used, naming the option
    p._damping = 0.02
    p._steps = 7  # kfac-pytorch's tests and scheduler set the counter
    assert p.steps == 7
    step(model, p, seed=1)
    assert p.steps == 8
    for bad in (-3, "7", 2.9, None, True):  # a counter its own checkpoint could not load
        with pytest.raises((ValueError, TypeError), match=r"_steps must be (an int )?in \[0"):
            p._steps = bad
    assert p.steps == 8


def test_lr_read_from_the_optimizer_is_a_callable_for_schedulers() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.07)
    p = KFACPreconditioner(model, optimizer=opt)
    assert callable(p._lr) and p.lr == 0.07
    with pytest.raises(ValueError, match="lr is already a callable"):
        LambdaParamScheduler(p, lr_lambda=lambda e: 0.5)
    p.lr = 0.2  # set by hand: no longer read from the optimizer
    assert p.lr == 0.2 and not callable(p._lr)


# -- schedulers -----------------------------------------------------------------------


def _by_epoch(alpha: float, epochs: list[int]):  # kfac-pytorch's CIFAR-10 example's rule
    def scale(epoch: int) -> float:
        factor = 1.0
        for e in epochs:
            if epoch >= e:
                factor *= alpha
        return factor

    return scale


def test_kaisa_scheduler_changes_intervals_exactly_as_kfac_pytorchs(tmp_path: Path) -> None:
    kfac = import_kfac(tmp_path)
    theirs_cls = kfac.scheduler.LambdaParamScheduler  # type: ignore[attr-defined]
    lambdas = dict(
        factor_update_steps_lambda=_by_epoch(2, [2, 4]),
        inv_update_steps_lambda=_by_epoch(2, [2, 4]),
        damping_lambda=_by_epoch(0.5, [3]),
        kl_clip_lambda=_by_epoch(0.9, [1]),
    )
    ours = KFACPreconditioner(mlp(), factor_update_steps=5, inv_update_steps=10, damping=0.1)
    other = KFACPreconditioner(mlp(), factor_update_steps=5, inv_update_steps=10, damping=0.1)
    mine, kfacs = LambdaParamScheduler(ours, **lambdas), theirs_cls(other, **lambdas)
    seen = []
    for epoch in range(1, 7):
        mine.step(step=epoch)
        kfacs.step(step=epoch)
        now = (ours.factor_update_steps, ours.inv_update_steps, ours.damping, ours.kl_clip)
        assert now == (
            other.factor_update_steps,
            other.inv_update_steps,
            other.damping,
            other.kl_clip,
        )
        seen.append(now[:2])
    # the example's rule compounds: ×2 at epoch 2, ×2·2 again from epoch 4
    assert seen == [(5, 10), (10, 20), (20, 40), (80, 160), (320, 640), (1280, 2560)]


def test_kaisa_scheduler_refuses_a_value_out_of_range_when_it_sets_it() -> None:
    p = KFACPreconditioner(mlp(), damping=0.1)
    s = LambdaParamScheduler(p, damping_lambda=lambda e: 0.0)
    with pytest.raises(ValueError, match=r"damping must be in \(0"):
        s.step()
    with pytest.raises(TypeError, match="damping_lambda must be a callable"):
        LambdaParamScheduler(p, damping_lambda=0.5)  # type: ignore[arg-type]


def test_an_unvalidated_value_is_refused_by_the_next_step_after_valid_ones() -> None:
    """The schedule validates a constant once (it is read six times a step):
    a new value set unvalidated through ``precond._damping`` is still
    refused by the next step, naming the option."""
    model = mlp()
    p = KFACPreconditioner(model, damping=0.1, factor_update_steps=1, inv_update_steps=1)
    x = torch.randn(8, 6)
    for _ in range(2):
        model(x).sum().backward()
        p.step()
    p._damping = -1.0
    model(x).sum().backward()
    with pytest.raises(ValueError, match=r"damping must be in \(0"):
        p.step()


def test_kfac_pytorchs_scheduler_drives_kaisa(tmp_path: Path) -> None:
    kfac = import_kfac(tmp_path)
    model = mlp()
    p = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
    sched = kfac.scheduler.LambdaParamScheduler(  # type: ignore[attr-defined]
        p, factor_update_steps_lambda=lambda e: 3, inv_update_steps_lambda=lambda e: 2
    )
    step(model, p)
    sched.step()
    assert (p.factor_update_steps, p.inv_update_steps) == (3, 4)
    captured = []
    for i in range(1, 7):
        captured.append(p._parts.capture.enabled)
        step(model, p, seed=i)
    assert captured == [i % 3 == 0 for i in range(1, 7)]  # factors every 3 steps now


# -- factor decay schedules -------------------------------------------------------------


def test_factor_decay_schedule_returning_zero_takes_the_batch_statistics(tmp_path: Path) -> None:
    import_kfac(tmp_path)
    from kfac.hyperparams import exp_decay_factor_averaging  # type: ignore[import-not-found]

    schedule = exp_decay_factor_averaging()
    assert schedule(0) == 0.0 and schedule(1) == 0.0
    model = mlp()
    p = KFACPreconditioner(model, **kfac_pytorch(factor_decay=schedule))
    step(model, p)
    first = [t.clone() for t in p.layers["0"].running]
    step(model, p, seed=1)  # decay 0 again: the second batch alone
    fresh_model = mlp()
    fresh_model.load_state_dict(model.state_dict())
    q = KFACPreconditioner(fresh_model, **kfac_pytorch(factor_decay=0.5))
    step(fresh_model, q, seed=1)
    for a, b in zip(p.layers["0"].running, q.layers["0"].running):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # one batch, nothing averaged
    assert not all(torch.equal(a, b) for a, b in zip(first, p.layers["0"].running))
    step(model, p, seed=2)  # decay 0.5 at step 2: an average now
    with pytest.raises(ValueError, match=r"factor_decay must be in \(0.0, 1.0\]"):
        KFACPreconditioner(mlp(), factor_decay=0.0)  # a constant 0 stays refused
    bad = KFACPreconditioner(model, factor_decay=lambda s: -0.1)
    with pytest.raises(ValueError, match=r"factor_decay\(0\) must be in \[0.0, 1.0\]"):
        step(model, bad, seed=3)


# -- checkpoints ----------------------------------------------------------------------


def test_kfac_pytorch_checkpoint_is_recognised_and_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    kfac = import_kfac(tmp_path)
    model = mlp()
    theirs = kfac.preconditioner.KFACPreconditioner(  # type: ignore[attr-defined]
        model, factor_update_steps=1, inv_update_steps=1, damping=0.003, lr=0.2
    )
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        model.zero_grad()
        F.cross_entropy(model(torch.randn(16, 6, generator=g)), torch.arange(16) % 3).backward()
        theirs.step()
    state = theirs.state_dict()
    assert is_kfac_pytorch_state(state)
    ours = KFACPreconditioner(mlp())
    assert not is_kfac_pytorch_state(ours.state_dict())
    with pytest.raises(ValueError, match=r"written by kfac-pytorch.*1/N².*batch size"):
        ours.load_state_dict(state)
    assert ours.steps == 0  # nothing changed
    ours.load_state_dict(kfac_pytorch_schedule(state))  # its steps and schedule, not factors
    assert ours.steps == 3 and ours.damping == 0.003 and ours.lr == 0.2
    assert not any(la.captured for la in ours.layers.values())


# -- what kfac-pytorch says --------------------------------------------------------------


def test_mem_opt_without_colocation_warns_and_is_honoured() -> None:
    with pytest.warns(UserWarning, match="colocate_factors=False under MEM-OPT"):
        p = KFACPreconditioner(
            mlp(), colocate_factors=False, grad_worker_fraction=DistributedStrategy.MEM_OPT
        )
    assert p.colocate_factors is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(mlp(), colocate_factors=False, lr=0.1)  # COMM-OPT: nothing to say


def test_one_log_record_per_registered_layer(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kaisa")
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    KFACPreconditioner(model, loglevel=logging.DEBUG)
    assert not caplog.records
    KFACPreconditioner(model, loglevel=logging.INFO)
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in messages if m.startswith("Registered")] == [
        'Registered name="0"',
        'Registered name="2"',
    ]
    assert sum(m.startswith('Skipped name="1"') for m in messages) == 1
    assert sum(m.startswith("KFAC layer assignments: WorkPlan") for m in messages) == 1


def test_reset_batch_folds_nothing_at_the_next_step_and_still_preconditions() -> None:
    model = mlp()
    p = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    step(model, p)
    before = [t.clone() for la in p.layers.values() for t in la.running]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = model[0].weight.grad.clone()
    p.reset_batch()
    p.step()
    after = [t for la in p.layers.values() for t in la.running]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing folded
    assert not torch.allclose(model[0].weight.grad, raw)  # still preconditioned
    step(model, p, seed=6)  # and the step after folds again
    assert not all(
        torch.equal(a, b)
        for a, b in zip(before, (t for la in p.layers.values() for t in la.running))
    )
