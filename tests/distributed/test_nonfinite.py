"""A NaN loss on one rank, under DDP and with hand-averaged gradients: every
rank skips the step together (no collective left waiting), the factors and
second-order state stay as they were, and the rest of the run equals the
run that never saw the bad batch, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa import KFACPreconditioner

from harness import run_distributed

pytestmark = pytest.mark.distributed

KW: dict[str, Any] = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2, grad_worker_fraction=0.5)
BAD = 9  # the seed of the poisoned batch


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batch(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * seed + rank)
    return torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (4,), generator=g
    )


def state(precond: KFACPreconditioner) -> dict[str, Any]:
    return precond.state_dict(include_second_order=True)


def train(rank: int, world: int, seeds: list[int], ddp: bool) -> dict[str, Any]:
    model = make_model()
    wrapped = DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(wrapped, optimizer=opt, **KW)
    out: dict[str, Any] = {}
    for seed in seeds:
        x, y = batch(seed, rank)
        opt.zero_grad()
        loss = F.cross_entropy(wrapped(x), y)
        if seed == BAD and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        if not ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        if seed == BAD:
            out["before"] = state(precond)
        precond.step()
        if seed == BAD:
            out["after"] = state(precond)
        else:
            opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["state"] = state(precond)
    out["skipped"] = precond.nonfinite_steps
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["steps"] == b["steps"] and all(
        torch.equal(v, b["layers"][n][k]) for n, e in a["layers"].items() for k, v in e.items()
    )


@pytest.mark.parametrize("ddp", [True, False], ids=["ddp", "hand-averaged"])
def test_nan_loss_on_one_rank_is_skipped_on_every_rank(ddp: bool) -> None:
    clean = run_distributed(2, train, [0, 1, 2, 3], ddp, timeout_s=60, pg_timeout_s=20)
    got = run_distributed(2, train, [0, 1, BAD, 2, 3], ddp, timeout_s=60, pg_timeout_s=20)
    for rank in range(2):
        assert got[rank]["skipped"] == 1, rank
        assert got[rank]["before"]["steps"] == 2 and same(got[rank]["before"], got[rank]["after"])
        assert same(got[rank]["state"], clean[rank]["state"]), rank
        for a, b in zip(got[rank]["params"], clean[rank]["params"]):
            assert torch.equal(a, b), rank
