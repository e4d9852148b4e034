"""Grafting, distributed, equals the one-process run.

``grafting='adam'`` keeps a running second moment of each layer's gradient
on the layer's gradient workers, updated from the averaged gradient they
precondition, and rescales ``V`` there before it is broadcast: on 2 gloo
ranks with half the batch each, the gradients, the parameters and the second
moments (read back through ``state_dict(include_second_order=True)``) after
several steps equal the one-process run on the whole batch (float64,
≤ 1e-10), under COMM-OPT (every rank a worker) and MEM-OPT
(``grad_worker_fraction=0.5``: one worker per layer, which broadcasts the
grafted ``V``), with the inverse and the eigen method; ``'sgd'`` under
MEM-OPT too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kaisa import KFACPreconditioner

from harness import run_distributed
from method_case import assert_runs_equal, make_model, train_steps

pytestmark = pytest.mark.distributed

B = 16
STEPS = 5
CONFIGS: list[dict[str, Any]] = [
    {"grafting": "adam", "compute_method": "inverse", "grad_worker_fraction": "comm-opt"},
    {"grafting": "adam", "compute_method": "inverse", "grad_worker_fraction": "mem-opt"},
    {"grafting": "adam", "compute_method": "eigen", "grad_worker_fraction": "mem-opt"},
    {"grafting": "sgd", "compute_method": "inverse", "grad_worker_fraction": "mem-opt"},
]


def train(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        kl_clip=None,
        factor_update_steps=1,
        inv_update_steps=2,
        factor_decay=0.8,
        damping=0.01,
        **config,
    )
    grads = train_steps(model, opt, precond, rank, world_size, STEPS, B)
    layers = precond.state_dict(include_second_order=True)["layers"]
    keys = ("graft_v", "graft_t") if config["grafting"] == "adam" else ()
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "moments": {n: {k: layers[n][k] for k in keys} for n in layers},
        "fraction": precond.plan.grad_worker_fraction,
    }


def run(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [train(rank, world_size, c) for c in CONFIGS]


def test_every_strategy_equals_one_process() -> None:
    references = [train(0, 1, c) for c in CONFIGS]
    ranks = run_distributed(2, run)
    assert_runs_equal(ranks, references, CONFIGS, "moments")
    assert [r["fraction"] for r in ranks[0]] == [1.0, 0.5, 0.5, 0.5]
    assert all(float(m["graft_t"]) == STEPS for m in references[0]["moments"].values())
