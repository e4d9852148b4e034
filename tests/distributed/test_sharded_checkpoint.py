"""Sharded checkpoints through torch.distributed.checkpoint: each rank writes
only the factors it owns and the second-order tensors of the layers it works
on, and the checkpoint loads at another world size, fraction and factor
layout — giving the same state, and the same training afterwards, as the
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


def save(rank: int, world: int, path: str, options: Any = None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    net, opt = make()
    precond = KFACPreconditioner(net, optimizer=opt, grad_worker_fraction=1.0, **(options or KW))
    train(net, opt, precond, range(3), rank, world)
    mine = precond.sharded_state_dict()
    dcp.save({"kfac": mine}, checkpoint_id=path)
    # the sharded checkpoint holds what the gathered one does: compare with one
    held = {k for k, v in mine["held"].items() if bool(v)}
    return {"keys": sorted(mine["factors"]), "held": held, "gathered": precond.state_dict()}


def load(
    rank: int,
    world: int,
    path: str,
    fraction: float,
    gathered: Any = None,
    options: Any = None,
) -> dict:
    """Resume (sharded, or from the gathered state_dict) and train 2 more steps;
    the model restarts from its initial weights either way, so only K-FAC's
    state differs between the two."""
    import torch.distributed.checkpoint as dcp

    net, opt = make()
    precond = KFACPreconditioner(
        net, optimizer=opt, grad_worker_fraction=fraction, **(options or KW)
    )
    if gathered is None:
        template = {"kfac": precond.sharded_state_dict()}
        dcp.load(template, checkpoint_id=path)
        precond.load_sharded_state_dict(template["kfac"])
    else:
        precond.load_state_dict(gathered)
    state = precond.state_dict()
    train(net, opt, precond, range(3, 5), rank, world)
    return {"steps": state["steps"], "gathered": state, "params": list(net.parameters())}


def test_each_rank_writes_its_own_and_any_world_size_reads(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(2, save, path)
    keys = [set(r["keys"]) for r in saved]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint: written once each
    reference = saved[0]["gathered"]
    entries = {f"{layer}.{key}" for layer, entry in reference["layers"].items() for key in entry}
    factors = {f"{layer}.{f}" for layer in reference["layers"] for f in ("A", "G")}
    assert keys[0] | keys[1] == entries & factors
    # at f = 1 both ranks work on every layer: each holds every second-order tensor
    assert saved[0]["held"] == saved[1]["held"] == entries - factors
    for world, fraction in ((4, 0.5), (1, 1.0)):
        for res in run_distributed(world, load, path, fraction):
            assert res["steps"] == 3
            got = res["gathered"]["layers"]
            for layer, entry in reference["layers"].items():
                for key, value in entry.items():
                    assert torch.equal(got[layer][key], value), (layer, key)


def _same_training(a: list[dict], b: list[dict]) -> bool:
    return all(
        torch.equal(p.detach(), q.detach())
        for x, y in zip(a, b, strict=True)
        for p, q in zip(x["params"], y["params"], strict=True)
    )


def test_sharded_resume_trains_like_the_gathered_one(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    gathered = run_distributed(2, save, path)[0]["gathered"]
    sharded = run_distributed(4, load, path, 0.5)
    plain = run_distributed(4, load, path, 0.5, gathered)
    assert _same_training(sharded, plain)


@pytest.mark.parametrize("saved_colocated", [False, True], ids=["split-to-one", "one-to-split"])
def test_a_new_factor_layout_loads_as_the_gathered_checkpoint_does(
    tmp_path, saved_colocated: bool
) -> None:
    """The eigen method's factors on two owners keep eigenvalues that one
    owner folds into the outer product: split → one resumes on the saved
    tensors, one → split lacks the eigenvalues and recomputes from the saved
    factors at the next step; either way as the gathered checkpoint loaded
    at that layout."""
    path = str(tmp_path / "ckpt")
    one = {**KW, "compute_method": "eigen", "colocate_factors": True}
    split = {**one, "colocate_factors": False}
    saved = run_distributed(
        1 if saved_colocated else 2, save, path, one if saved_colocated else split
    )[0]
    world, options = (2, split) if saved_colocated else (1, one)
    sharded = run_distributed(world, load, path, 1.0, None, options)
    plain = run_distributed(world, load, path, 1.0, saved["gathered"], options)
    assert _same_training(sharded, plain)
    reference = saved["gathered"]["layers"]
    for res in sharded:
        got = res["gathered"]["layers"]
        for layer, entry in got.items():
            for key, value in entry.items():
                if key in reference[layer]:
                    assert torch.equal(value, reference[layer][key]), (layer, key)
        # one → split: the eigenvalues were not saved, and a state taken
        # before the next step (which recomputes them) leaves them out rather
        # than saving stand-ins; split → one: nothing is missing.  Either way
        # it holds nothing the checkpoint did not.
        invented = {
            key for layer, entry in got.items() for key in set(entry) - set(reference[layer])
        }
        assert not invented, invented


def load_damaged(rank: int, world: int, path: str, how: str) -> dict[str, Any]:
    """Load with one factor of rank 1's part turned NaN, or made asymmetric,
    after dcp.load (a file damaged on disk); return what each rank raised
    and whether anything moved."""
    import torch.distributed.checkpoint as dcp

    net, opt = make()
    precond = KFACPreconditioner(net, optimizer=opt, grad_worker_fraction=1.0, **KW)
    template = {"kfac": precond.sharded_state_dict()}
    dcp.load(template, checkpoint_id=path)
    if rank == 1:
        owned = template["kfac"]["factors"].values()
        if how == "nan":
            next(iter(owned)).fill_(float("nan"))
        else:  # a dense one (an Embedding's A is a diagonal)
            next(f for f in owned if f.dim() == 2)[0, -1] += 1.0
    try:
        precond.load_sharded_state_dict(template["kfac"])
        error = ""
    except ValueError as exc:
        error = str(exc)
    untouched = all(f is None for la in precond.layers.values() for f in la.running)
    # the ranks go on together: a collective after the refusal completes
    torch.distributed.barrier()
    return {"error": error, "untouched": untouched, "steps": precond.steps}


@pytest.mark.parametrize(("how", "cause"), [("nan", "NaN or Inf"), ("asymmetric", "not symmetric")])
def test_a_part_damaged_on_one_rank_is_refused_on_every_rank(tmp_path, how, cause) -> None:
    """Only rank 1 can see the damage in the factor it owns; both ranks refuse
    the load, naming the cause where it was seen, and neither changes."""
    path = str(tmp_path / "ckpt")
    run_distributed(2, save, path)
    results = run_distributed(2, load_damaged, path, how)
    assert cause in results[1]["error"]
    assert "another rank refused" in results[0]["error"]
    assert all(r["untouched"] and r["steps"] == 0 for r in results)
