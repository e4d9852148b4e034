"""Lower-precision products change nothing that is sent.

``precondition_dtype`` and ``factor_compute_dtype`` act where the products
run: factors are still reduced in ``factor_dtype``, decompositions still
broadcast in ``inv_dtype``, preconditioned gradients in the gradient's dtype.
So every collective carries the same bytes as without the options, and the
only difference in memory is the cast copies a gradient worker keeps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from kaisa import KFACPreconditioner

from harness import run_distributed
from test_comm_memory_checkpoint import record_steps

pytestmark = pytest.mark.distributed

WIDTH, DEPTH, B = 12, 3, 8
BF16 = dict(precondition_dtype=torch.bfloat16, factor_compute_dtype=torch.bfloat16)


def run(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).double()
        precond = KFACPreconditioner(
            model, lr=0.1, damping=0.01, grad_worker_fraction=0.5, inv_update_steps=2, **config
        )
        record = record_steps(model, precond, rank, world, 3, B, WIDTH)
        record["dtypes"] = {t.dtype for la in precond.layers.values() for t in la.state.values()}
        out.append(record)
    return out


def test_bf16_products_send_the_same_bytes_and_keep_the_stored_dtype() -> None:
    results = run_distributed(4, run, [{}, BF16])
    for default, bf16 in results:
        assert bf16["comm"] == default["comm"]  # every kind, bytes and calls, every step
        assert bf16["dtypes"] <= {torch.float64} and default["dtypes"] <= {torch.float64}
        before, after = default["memory"][-1], bf16["memory"][-1]
        assert after["factors"] == before["factors"]
        # HYBRID-OPT: half the ranks are workers of a layer; a worker adds
        # bfloat16 copies (2 bytes) of its float64 tensors (8 bytes)
        assert after["second_order"] == before["second_order"] * 10 // 8
