"""The model and loop the per-method invariance tests train (EKFAC, ekfac_adam).

A float64 CNN with two convolutions and two Linear layers, trained on
batches drawn the same on every rank and split between the ranks, with the
gradients averaged by hand: a method that is exact under distribution gives
every rank the gradients of the one-process run on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3, stride=2, padding=1, bias=False),
        nn.Flatten(),
        nn.Linear(27, 6),
        nn.Tanh(),
        nn.Linear(6, 5),
    ).double()


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    precond: Any,
    rank: int,
    world_size: int,
    steps: int,
    batch: int,
) -> list[list[torch.Tensor]]:
    """``steps`` steps on ``2 * batch`` samples split over the ranks; the
    preconditioned gradients of every step."""
    g = torch.Generator().manual_seed(123)
    share = 2 * batch // world_size
    grads = []
    for _ in range(steps):
        x = torch.randn(2 * batch, 2, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (2 * batch,), generator=g)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if world_size > 1:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size
        precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_runs_equal(
    ranks: list[list[dict[str, Any]]],
    references: list[dict[str, Any]],
    configs: list[Any],
    state: str,
    tol: float = 1e-10,
) -> None:
    """Every rank's run of every config equals the one-process run: the
    gradients at each step, the parameters, and the method's state tensors
    kept under ``state`` (``{layer: tensor}`` or ``{layer: {key: tensor}}``)."""
    for rank, results in enumerate(ranks):
        for config, got, ref in zip(configs, results, references, strict=True):
            what = f"rank {rank} {config}"
            for step, (gs, rs) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
                for a, b in zip(gs, rs, strict=True):
                    assert rel(a, b) <= tol, f"{what}: step {step} rel err {rel(a, b):.2e}"
            for a, b in zip(got["params"], ref["params"], strict=True):
                assert rel(a, b) <= tol, what
            for name, held in ref[state].items():
                pairs = held.items() if isinstance(held, dict) else [("", held)]
                for key, value in pairs:
                    mine = got[state][name][key] if key else got[state][name]
                    err = rel(mine, value)
                    assert err <= tol, f"{what}: {name}.{key or state} rel err {err:.2e}"
