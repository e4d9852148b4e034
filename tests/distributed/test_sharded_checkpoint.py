"""Sharded checkpoints through torch.distributed.checkpoint: each rank writes
only the factors it owns, and the checkpoint loads at another world size and
fraction — giving the same factors, and the same training afterwards, as the
gathered state_dict()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from harness import run_distributed

pytestmark = pytest.mark.distributed
KW: dict[str, Any] = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2)


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Embedding(13, 6), nn.Flatten(), nn.Linear(18, 7), nn.Tanh(), nn.Linear(7, 4)
    ).double()
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randint(0, 13, (8, 3), generator=g), torch.randint(0, 4, (8,), generator=g)
    share = 8 // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def train(net, opt, precond, steps: range, rank: int, world: int) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank, world)
        F.cross_entropy(net(x), y).backward()
        if world > 1:
            for p in net.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        opt.step()


def save(rank: int, world: int, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    net, opt = make()
    precond = KFACPreconditioner(net, optimizer=opt, grad_worker_fraction=1.0, **KW)
    train(net, opt, precond, range(3), rank, world)
    mine = precond.sharded_state_dict()
    dcp.save({"kfac": mine}, checkpoint_id=path)
    # the sharded checkpoint holds the factors: compare with a gathered one of the same
    gathered = precond.state_dict(include_second_order=False)
    return {"keys": sorted(mine["factors"]), "gathered": gathered}


def load(rank: int, world: int, path: str, fraction: float, gathered: Any = None) -> dict:
    """Resume (sharded, or from the gathered state_dict) and train 2 more steps;
    the model restarts from its initial weights either way, so only K-FAC's
    state differs between the two."""
    import torch.distributed.checkpoint as dcp

    net, opt = make()
    precond = KFACPreconditioner(net, optimizer=opt, grad_worker_fraction=fraction, **KW)
    if gathered is None:
        template = {"kfac": precond.sharded_state_dict()}
        dcp.load(template, checkpoint_id=path)
        precond.load_sharded_state_dict(template["kfac"])
    else:
        precond.load_state_dict(gathered)
    state = precond.state_dict(include_second_order=False)
    train(net, opt, precond, range(3, 5), rank, world)
    return {"steps": state["steps"], "gathered": state, "params": list(net.parameters())}


def test_each_rank_writes_its_own_and_any_world_size_reads(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(2, save, path)
    keys = [set(r["keys"]) for r in saved]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint: written once each
    reference = saved[0]["gathered"]
    assert keys[0] | keys[1] == {
        f"{layer}.{factor}" for layer, entry in reference["layers"].items() for factor in entry
    }
    for world, fraction in ((4, 0.5), (1, 1.0)):
        for res in run_distributed(world, load, path, fraction):
            assert res["steps"] == 3
            got = res["gathered"]["layers"]
            for layer, entry in reference["layers"].items():
                for factor, value in entry.items():
                    assert torch.equal(got[layer][factor], value), (layer, factor)


def test_sharded_resume_trains_like_the_gathered_one(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    gathered = run_distributed(2, save, path)[0]["gathered"]
    sharded = run_distributed(4, load, path, 0.5)
    plain = run_distributed(4, load, path, 0.5, gathered)
    for a, b in zip(sharded, plain):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p.detach(), q.detach())
