"""The planner's predictions equal what a run measures, exactly.

For every strategy at W=1, 2, 4 (and symmetry-aware packing, the inverse
method with split factors, no eigenvalue outer product, hand-averaged
gradients), the bytes ``kaisa.planner.forecast`` predicts for each rank and kind of
step equal ``comm_stats()['step']`` kind by kind, and the predicted K-FAC
memory equals ``memory_usage()`` on every rank — well inside the 10% the
issue allows.  The model has conv, linear, embedding (diagonal factor) and
attention (rows of a shared parameter) layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.methods import InverseMethod
from kaisa.planner.forecast import forecast, layer_costs

from harness import run_distributed

pytestmark = pytest.mark.distributed

INTERVALS = dict(factor_update_steps=1, inv_update_steps=2)
CONFIGS: list[dict[str, Any]] = [
    dict(grad_worker_fraction=1.0),
    dict(grad_worker_fraction=0.5),
    dict(grad_worker_fraction=0.0),
    dict(
        grad_worker_fraction=0.5,
        symmetry_aware=True,
        compute_method="inverse",
        colocate_factors=False,
    ),
    dict(grad_worker_fraction=1.0, colocate_factors=False, compute_eigenvalue_outer_product=False),
    dict(grad_worker_fraction=0.0, allreduce_bucket_cap_mb=0, factor_dtype=torch.float32),
    dict(grad_worker_fraction=0.5, precondition_dtype=torch.bfloat16),  # + the cast copies
    # the method the preconditioner resolves: grafting's running moments, a user's method=
    dict(grad_worker_fraction=0.5, grafting="adam"),
    dict(grad_worker_fraction=0.0, grafting="sgd", method=InverseMethod()),
    dict(grad_worker_fraction=1.0, grafting="adam", method=InverseMethod()),
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.emb = nn.Embedding(11, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.fc = nn.Linear(3 * 16 + 6, 7)
        self.head = nn.Linear(7, 5, bias=False)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        e = self.emb(tok)
        a, _ = self.attn(e, e, e, need_weights=False)
        h = torch.cat([F.relu(self.conv(img)).flatten(1), a.mean(1)], 1)
        return self.head(torch.tanh(self.fc(h)))


def net() -> nn.Module:
    torch.manual_seed(0)
    return Net().double()


def measure(rank: int, world: int, config: dict[str, Any], ddp: bool) -> list[tuple[dict, dict]]:
    model: nn.Module = net()
    if world > 1 and ddp:
        model = nn.parallel.DistributedDataParallel(model)
    precond = KFACPreconditioner(model, **INTERVALS, **config)
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * rank + step)
        img = torch.randn(4, 2, 6, 6, generator=g, dtype=torch.float64)
        tok = torch.randint(0, 11, (4, 5), generator=g)
        model.zero_grad()
        F.cross_entropy(model(img, tok), torch.randint(0, 5, (4,), generator=g)).backward()
        if world > 1 and not ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        stats = {k: v["bytes"] for k, v in precond.comm_stats()["step"].items() if v["bytes"]}
        out.append((stats, precond.memory_usage()))
    return out


def check(world: int, config: dict[str, Any], ddp: bool = True) -> None:
    runs = (
        run_distributed(world, measure, config, ddp) if world > 1 else [measure(0, 1, config, ddp)]
    )
    predicted = forecast(
        layer_costs(net(), **config), world, gradients_agree=ddp, **INTERVALS, **config
    )
    for rank, steps in enumerate(runs):
        for step, (stats, memory) in enumerate(steps):
            where = f"W={world} {config} rank {rank} step {step}"
            assert stats == predicted.step_bytes(rank, True, step % 2 == 0), where
            assert stats or world == 1, where  # the check is not vacuous
            assert memory == {k: int(v[rank]) for k, v in predicted.memory.items()}, where


@pytest.mark.parametrize("world", [1, 2, 4])
def test_predicted_bytes_and_memory_equal_the_run(world: int) -> None:
    for config in CONFIGS:
        if world == 1 and config["grad_worker_fraction"] == 0.5:
            continue  # not a fraction of one rank
        check(world, config)


def test_hand_averaged_gradients_add_the_presence_vote() -> None:
    check(2, dict(grad_worker_fraction=0.5), ddp=False)


def auto_run(rank: int, world: int, budget_mb: float) -> tuple[float, int]:
    model = nn.parallel.DistributedDataParallel(net())
    precond = KFACPreconditioner(
        model, grad_worker_fraction="auto", memory_budget_mb=budget_mb, **INTERVALS
    )
    g = torch.Generator().manual_seed(rank)
    img = torch.randn(4, 2, 6, 6, generator=g, dtype=torch.float64)
    tok = torch.randint(0, 11, (4, 5), generator=g)
    F.cross_entropy(model(img, tok), torch.randint(0, 5, (4,), generator=g)).backward()
    precond.step()
    return precond.plan.grad_worker_fraction, precond.memory_usage()["total"]


def test_auto_fraction_fits_the_budget_and_every_rank_agrees() -> None:
    from kaisa.planner.forecast import choose_fraction

    layers = layer_costs(net())
    options = {fc.fraction: fc for fc in choose_fraction(layers, 4, **INTERVALS)[1]}
    most, least = options[1.0].memory["total"].max(), options[0.25].memory["total"].max()
    assert least < most  # the budget below excludes COMM-OPT
    budget_mb = (least + most) / 2 / 2**20
    chosen, _ = choose_fraction(layers, 4, None, budget_mb * 2**20, **INTERVALS)
    assert chosen < 1.0
    results = run_distributed(4, auto_run, budget_mb)
    assert {fraction for fraction, _ in results} == {chosen}
    assert all(memory <= budget_mb * 2**20 for _, memory in results)
