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
