"""Adam in K-FAC's eigenbasis, distributed, equals the one-process run.

The moments are updated by each layer's gradient workers from the averaged
gradient they precondition, so every worker holds the same moments and any
``grad_worker_fraction`` runs the one-process method: on 2 gloo ranks with
half the batch each, the gradients, the parameters and the moments (read
back through ``state_dict(include_second_order=True)``, a collective that
gathers them from each layer's worker) after several steps — three new
bases, each carrying the moments over — equal the one-process run on the
whole batch (float64, ≤ 1e-10): under COMM-OPT with factors colocated or
split and updated in the hooks or at ``step()``, and under MEM-OPT
(``grad_worker_fraction=0.5``: one worker per layer, which broadcasts ``V``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kaisa import KFACPreconditioner
from kaisa.methods.ekfac_adam import EKFACAdamMethod

from harness import run_distributed
from method_case import assert_runs_equal, make_model, train_steps

pytestmark = pytest.mark.distributed

#: samples per rank: 2·B ≥ 28 rows make every factor nonsingular (an
#: elementwise step in an eigenbasis depends on the basis of a null space)
B = 16
STEPS = 6
CONFIGS: list[dict[str, Any]] = [
    {},
    {"update_factors_in_hook": False, "colocate_factors": False},
    {"grad_worker_fraction": 0.5},
]


def train(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        # ε well above rounding: Adam's c/(√v̂ + ε) amplifies a coordinate's
        # rounding by c/ε where c is tiny (the first step is sign-like)
        method=EKFACAdamMethod(eps=1e-3),
        kl_clip=0.05,
        factor_update_steps=1,
        inv_update_steps=2,
        factor_decay=0.8,
        **config,
    )
    grads = train_steps(model, opt, precond, rank, world_size, STEPS, B)
    layers = precond.state_dict(include_second_order=True)["layers"]
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "moments": {n: {k: layers[n][k] for k in ("adam_m", "adam_v", "adam_t")} for n in layers},
        "fraction": precond.plan.grad_worker_fraction,
    }


def run(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [train(rank, world_size, c) for c in CONFIGS]


def test_every_strategy_equals_one_process() -> None:
    references = [train(0, 1, c) for c in CONFIGS]
    ranks = run_distributed(2, run)
    assert_runs_equal(ranks, references, CONFIGS, "moments")
    assert [r["fraction"] for r in ranks[0]] == [1.0, 1.0, 0.5]
    assert all(float(m["adam_t"]) == STEPS for m in references[0]["moments"].values())
