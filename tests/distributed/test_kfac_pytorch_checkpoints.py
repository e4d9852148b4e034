"""kfac-pytorch's checkpoint pattern on 2 gloo ranks: ``state_dict()`` called on
rank 0 only never hangs; a late rank agrees with the early one; a complete
round still works afterwards; a partial checkpoint loads.  Also kfac-pytorch's
enum members and reported fractions at W = 2."""

from __future__ import annotations

import enum
import time
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from harness import run_distributed

pytestmark = pytest.mark.distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, precond: KFACPreconditioner, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():  # hand-averaged gradients, as DDP would
            torch.distributed.all_reduce(p.grad)
            p.grad /= 2
        precond.step()
        opt.step()


def _rank_zero_only(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    precond = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=2, colocate_factors=True
    )
    _train(model, precond, rank, 3)
    out: dict[str, Any] = {}
    if rank == 0:  # kfac-pytorch's examples: save on rank 0 only
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            partial = precond.state_dict(timeout_s=1.0)
        out["seconds"] = time.monotonic() - start
        out["warned"] = any("not on every rank" in str(w.message) for w in caught)
        out["partial"] = partial
    _train(model, precond, rank, 2)  # the collectives still line up
    # a late rank: rank 1 arrives after rank 0 gave up; both get partial states
    if rank == 1:
        time.sleep(4.0)  # past rank 0's 1 s (a FileStore polls: up to ~2 s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        late = precond.state_dict(timeout_s=1.0)
    out["late_partial"] = "partial" in late
    _train(model, precond, rank, 1)
    full = precond.state_dict(timeout_s=30.0)  # every rank: complete, as before
    out["full_partial"] = "partial" in full
    out["full_layers"] = {n: sorted(e) for n, e in full["layers"].items()}
    out["owners"] = {n: precond.plan.layer(n).owners for n in precond.layers}
    # the partial checkpoint loads on every rank: rank 0's layers restored
    resumed = _model()
    fresh = KFACPreconditioner(resumed, factor_update_steps=1, inv_update_steps=2)
    state = out.get("partial")
    objects = [state]
    torch.distributed.broadcast_object_list(objects, src=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(objects[0])
    out["load_warned"] = any("start their statistics afresh" in str(w.message) for w in caught)
    out["captured"] = {n: la.captured for n, la in fresh.layers.items()}
    # under COMM-OPT rank 0 held every layer's second-order state: all of it
    # is restored, the fresh layers' too, until their next inverse update
    out["decomposed"] = {n: la.decomposed for n, la in fresh.layers.items()}
    out["state_restored"] = all(
        torch.equal(la.state[k], objects[0]["layers"][n][k])
        for n, la in fresh.layers.items()
        for k in la.state
    ) and all(la.state for la in fresh.layers.values())
    _train(resumed, fresh, rank, 2)  # and trains on: the fresh layers are captured anew
    out["captured_after"] = all(la.captured for la in fresh.layers.values())
    return out


def test_state_dict_on_rank_zero_only_returns_its_share_without_hanging() -> None:
    r0, r1 = run_distributed(2, _rank_zero_only, timeout_s=120.0)
    assert r0["warned"] and r0["seconds"] < 5.0
    partial = r0["partial"]
    assert partial["partial"] == {"rank": 0, "world_size": 2}
    owners = r0["owners"]
    for name, entry in partial["layers"].items():
        mine = [o == 0 for o in owners[name]]
        # exactly the factors rank 0 owns (colocated: all of a layer's or none)
        assert ("A" in entry) == mine[0] and ("G" in entry) == mine[1], (name, entry.keys())
    assert r0["late_partial"] and r1["late_partial"]  # the latecomer agreed: no hang
    assert not r0["full_partial"] and not r1["full_partial"]
    for name in owners:
        assert {"A", "G"} <= set(r0["full_layers"][name])
    for r in (r0, r1):
        assert r["load_warned"]
        assert r["captured"] == {n: all(o == 0 for o in owners[n]) for n in owners}
        assert all(r["decomposed"].values()) and r["state_restored"]
        assert r["captured_after"]
    assert any(r0["captured"].values()) and not all(r0["captured"].values())


class DistributedStrategy(enum.Enum):  # kfac.enums.DistributedStrategy, as a script has it
    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


def _fractions(rank: int, world: int) -> list[tuple[float, str]]:
    out = []
    for given in (DistributedStrategy.COMM_OPT, DistributedStrategy.MEM_OPT, 0, 0.5, 1):
        p = KFACPreconditioner(_model(), grad_worker_fraction=given)
        out.append((p.grad_worker_fraction, p.distributed_strategy.name))
        assert p.distributed_strategy == getattr(DistributedStrategy, p.distributed_strategy.name)
    return out


def test_kfac_pytorch_strategies_and_reported_fractions_at_two_ranks() -> None:
    r0, r1 = run_distributed(2, _fractions)
    assert (
        r0
        == r1
        == [
            (1.0, "COMM_OPT"),
            (0.5, "MEM_OPT"),
            (0.5, "MEM_OPT"),
            (0.5, "MEM_OPT"),
            (1.0, "COMM_OPT"),
        ]
    )


def _mirrored(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    precond = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=2, grad_worker_fraction=0.5
    )  # MEM-OPT at W = 2: each layer's factors and second order on one rank
    _train(model, precond, rank, 3)
    out: dict[str, Any] = {"owners": {n: precond.plan.layer(n).owners for n in precond.layers}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if rank == 0:
            out["first"] = precond.state_dict(timeout_s=1.0)  # asks for the mirror (from step 5)
    out["mirror_bytes_before"] = precond.comm_stats()["total"].get("checkpoint_mirror", {})
    _train(model, precond, rank, 4)  # steps 3..6: the inverse update at 6 refreshes it
    out["mine"] = {
        (n, s.name): r.clone()
        for n, la in precond.layers.items()
        for s, r in zip(la.factors, la.running)
        if r is not None
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:
            out["second"] = precond.state_dict(timeout_s=1.0)
    out["said"] = " ".join(str(w.message) for w in caught)
    out["mirror_bytes"] = precond.comm_stats()["total"].get("checkpoint_mirror", {})
    return out


def test_a_save_on_rank_zero_alone_starts_a_mirror_that_completes_the_next_ones() -> None:
    r0, r1 = run_distributed(2, _mirrored, timeout_s=120.0)
    owners = r0["owners"]
    theirs = [n for n in owners if all(o == 1 for o in owners[n])]
    assert theirs, owners  # some layer lives on rank 1 alone
    first, second = r0["first"], r0["second"]
    assert all(not first["layers"][n] for n in theirs)  # the first save: rank 0's share
    assert not r0["mirror_bytes_before"] and not r1["mirror_bytes_before"]  # nothing sent yet
    assert second["partial"]["mirrored_at"] == 6 and "as of the inverse update" in r0["said"]
    for name in owners:  # the second: every layer's factors
        assert {"A", "G"} <= set(second["layers"][name]), name
    for name in theirs:  # rank 1's, exactly as rank 1 held them after step 6
        for factor in ("A", "G"):
            assert torch.equal(second["layers"][name][factor], r1["mine"][(name, factor)])
    assert r0["mirror_bytes"]["calls"] > 0 and r1["mirror_bytes"]["calls"] > 0
