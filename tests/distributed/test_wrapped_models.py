"""DDP-wrapped models: deep copies (EMA/teacher) and checkpoints across wrappers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa import KFACPreconditioner

from harness import run_distributed

pytestmark = pytest.mark.distributed


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [
        (
            torch.randn(4, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (4,), generator=g),
        )
        for _ in range(3)
    ]


def train_ddp(rank: int, world: int, with_teacher: bool) -> dict[str, Any]:
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(ddp, damping=0.01, kl_clip=0.05)
    teacher = copy.deepcopy(ddp) if with_teacher else None  # fails without kaisa's inert hooks
    for x, y in batches(rank):
        opt.zero_grad()
        if teacher is not None:  # a training-mode forward/backward of the copy
            F.cross_entropy(teacher(x.flip(0)), y).backward()
        F.cross_entropy(ddp(x), y).backward()
        precond.step()
        opt.step()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "names": list(precond.layers),
        "state": precond.state_dict(),
        "agree": precond.comm_stats()["total"].get("agree"),
    }


def test_deepcopy_of_ddp_model_captures_nothing_and_checkpoint_loads_unwrapped() -> None:
    plain = run_distributed(2, train_ddp, False)
    copied = run_distributed(2, train_ddp, True)
    for a, b in zip(plain, copied):
        assert a["names"] == ["0", "2"]  # no "module." prefix
        assert a["agree"] is None  # DDP guarantees every rank has the same gradients
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)  # the teacher changed nothing
    # a checkpoint taken under DDP loads into an unwrapped model's preconditioner
    target = KFACPreconditioner(make_model())
    target.load_state_dict(plain[0]["state"])
    assert target.steps == 3
    for name in ("0", "2"):
        assert torch.equal(target.layers[name].factor("A"), plain[0]["state"]["layers"][name]["A"])


def scaled_ddp(rank: int, world: int, poison: bool, fraction: float) -> dict[str, Any]:
    """DDP + GradScaler; with ``poison`` rank 1's loss of the second batch is Inf."""
    model = make_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    precond = KFACPreconditioner(
        ddp, optimizer=opt, grad_scaler=scaler, grad_worker_fraction=fraction, damping=0.01
    )
    data = batches(rank)
    if poison:
        data.insert(1, data[0])
    steps = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        if poison and i == 1 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        precond.step()
        steps.append(precond.steps)
        scaler.step(opt)
        scaler.update()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": precond.state_dict(include_second_order=True),
        "steps": steps,
    }


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_step_skipped_by_the_scaler_is_skipped_on_every_rank(fraction: float) -> None:
    clean = run_distributed(2, scaled_ddp, False, fraction)
    poisoned = run_distributed(2, scaled_ddp, True, fraction)
    for a, b in zip(clean, poisoned):
        assert b["steps"] == [1, 1, 2, 3]  # the Inf step did not count, on either rank
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)
        for name, entry in a["state"]["layers"].items():
            for key, value in entry.items():
                assert torch.equal(b["state"]["layers"][name][key], value), f"{name}.{key}"
