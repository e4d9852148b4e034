"""EKFAC distributed equals EKFAC in one process; fractions below 1 are refused.

Under COMM-OPT (``grad_worker_fraction=1``) every rank holds every layer's
eigenbases, forms its own examples' per-example second moment in them, and
the sums are all-reduced onto every rank: on 2 gloo ranks with half the batch
each, the gradients, parameters and ``S`` after several steps (inverse updates
and the factor steps between them) equal the one-process run on the whole
batch (float64, ≤ 1e-10), with factor updates in the hooks or at ``step()``
and with the factors colocated or split.  Other fractions keep the bases on
some ranks only: construction refuses them with a ``ValueError`` naming the
option, the method and the reason; ``'auto'`` picks COMM-OPT.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kaisa import KFACPreconditioner

from harness import run_distributed
from method_case import assert_runs_equal, make_model, train_steps

pytestmark = pytest.mark.distributed

#: samples per rank: 2·B ≥ 28 rows make every factor nonsingular.  A singular
#: factor's eigenbasis is arbitrary in its null space, and EKFAC's S (unlike
#: λ_G λ_Aᵀ) depends on it, so rounding would pick different bases per run
B = 16
STEPS = 5
CONFIGS: list[dict[str, Any]] = [
    {},
    {"update_factors_in_hook": False, "colocate_factors": False},
]


def train(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        compute_method="ekfac",
        damping=0.01,
        kl_clip=0.05,
        factor_update_steps=1,
        inv_update_steps=3,
        factor_decay=0.8,
        **config,
    )
    grads = train_steps(model, opt, precond, rank, world_size, STEPS, B)
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "s": {n: la.state["ekfac_s"].clone() for n, la in precond.layers.items()},
        "statistic_bytes": precond.comm_stats()["total"].get("statistic_allreduce", {}),
    }


def run(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [train(rank, world_size, c) for c in CONFIGS]


def test_comm_opt_equals_one_process() -> None:
    references = [train(0, 1, c) for c in CONFIGS]
    ranks = run_distributed(2, run)
    assert_runs_equal(ranks, references, CONFIGS, "s")
    for results in ranks:  # S was summed over the ranks (not formed from this rank's half alone)
        assert all(got["statistic_bytes"].get("calls", 0) > 0 for got in results)
    # the per-example statistics moved S away from the eigenvalues' outer product
    assert any(not torch.allclose(s, s.mean()) for s in references[0]["s"].values())


def construct(rank: int, world_size: int, fraction: Any) -> str | float:
    try:
        precond = KFACPreconditioner(
            make_model(), compute_method="ekfac", grad_worker_fraction=fraction
        )
    except ValueError as exc:
        return str(exc)
    return precond.plan.grad_worker_fraction


def test_fractions_below_one_are_refused_and_auto_picks_comm_opt() -> None:
    for fraction, shown in ((0.5, "0.5"), ("mem-opt", "'mem-opt'")):
        for message in run_distributed(2, construct, fraction):
            assert isinstance(message, str), message
            assert f"grad_worker_fraction={shown}" in message
            assert "compute_method='ekfac'" in message and "eigenbases" in message
    assert run_distributed(2, construct, "auto") == [1.0, 1.0]
