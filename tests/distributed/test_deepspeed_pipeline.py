"""DeepSpeed's pipeline engine (2 stages × 2 data-parallel ranks, ZeRO 0):
kaisa runs in the optimizer's step pre-hook inside ``train_batch()``; each
stage preconditions its own layers with its data-parallel peer, the KL clip
sums over the stages, and the result equals one process training the whole
model on the whole batch.  A batch with a NaN is skipped, update included:
the run ends bit-identical to one that left the batch out."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from deepspeed_case import ACCUMULATE, BATCH, KW, deepspeed_or_skip, join
from harness import run_distributed

pytestmark = pytest.mark.distributed
deepspeed_or_skip()

STAGES, REPLICAS, STEPS = 2, 2, 3


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)]


def data(replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(40 + replica)
    return [
        (torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(STEPS * ACCUMULATE)
    ]


def pipeline_run(
    rank: int, world: int, kl_clip: float, nan_at: int | None = None, leave_out: bool = False
) -> dict[str, Any]:
    """``nan_at``: replica 0's first micro-batch of that optimizer step holds
    a NaN, or (``leave_out``) that step's micro-batches are left out."""
    deepspeed = join(rank, world)
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    module = PipelineModule(
        layers=layers(),
        num_stages=STAGES,
        loss_fn=lambda out, y: F.cross_entropy(out, y),
        partition_method="uniform",
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": ACCUMULATE,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=optimizer, config=cfg, dist_init_required=False
    )
    precond = KFACPreconditioner(engine, **{**KW, "kl_clip": kl_clip})
    replica = engine.grid.get_data_parallel_id()
    micro = data(replica)
    steps = STEPS
    if nan_at is not None and leave_out:
        del micro[nan_at * ACCUMULATE : (nan_at + 1) * ACCUMULATE]
        steps -= 1
    elif nan_at is not None and replica == 0:
        x, y = micro[nan_at * ACCUMULATE]
        micro[nan_at * ACCUMULATE] = (x * float("nan"), y)
    batches = iter(micro)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            engine.train_batch(batches)
    return {
        "stage": engine.grid.get_stage_id(),
        "layers": sorted(precond.layers),
        "steps": precond.steps,
        "skipped": engine.skipped_steps,
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "momenta": [s["momentum_buffer"].clone() for s in optimizer.state.values()],
        "warnings": [str(w.message) for w in caught if "non-finite" in str(w.message)],
    }


def reference(kl_clip: float) -> dict[str, torch.Tensor]:
    """One process, the whole model, each micro-batch the replicas' together."""
    net = nn.Sequential(*layers())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        net, optimizer=optimizer, accumulation_steps=ACCUMULATE, **{**KW, "kl_clip": kl_clip}
    )
    shards = [data(r) for r in range(REPLICAS)]
    for step in range(STEPS):
        optimizer.zero_grad()
        for m in range(step * ACCUMULATE, (step + 1) * ACCUMULATE):
            x = torch.cat([s[m][0] for s in shards])
            y = torch.cat([s[m][1] for s in shards])
            (F.cross_entropy(net(x), y) / ACCUMULATE).backward()
        precond.step()
        optimizer.step()
    return {n: p.detach() for n, p in net.named_parameters()}


@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_pipeline_stages_equal_one_process(kl_clip: float | None) -> None:
    """With a tight KL clip ν < 1 couples the stages: a per-stage clip would differ."""
    want = reference(kl_clip)
    results = run_distributed(STAGES * REPLICAS, pipeline_run, kl_clip, timeout_s=400)
    assert {r["stage"] for r in results} == {0, 1}
    assert sorted(n for r in results[::REPLICAS] for n in r["layers"]) == ["0", "2", "4"]
    for res in results:
        assert res["steps"] == STEPS
        for name, value in res["params"].items():
            err = float((value - want[name]).norm() / want[name].norm())
            assert err <= 1e-5, (name, err)


def test_a_batch_with_a_nan_is_skipped_update_included() -> None:
    """kaisa runs inside train_batch(), so nothing else could skip the
    update: it takes the stage's gradients away and marks the step an
    overflow (both stages, both replicas: the verdict is agreed)."""
    bad = run_distributed(STAGES * REPLICAS, pipeline_run, 0.001, 1, timeout_s=400)
    left_out = run_distributed(STAGES * REPLICAS, pipeline_run, 0.001, 1, True, timeout_s=400)
    for got, want in zip(bad, left_out, strict=True):
        assert got["skipped"] == 1 and want["skipped"] == 0
        assert got["steps"] == want["steps"] == STEPS - 1
        for name, value in got["params"].items():
            assert torch.equal(value, want["params"][name]), name
        assert len(got["momenta"]) == len(want["momenta"]) > 0
        for a, b in zip(got["momenta"], want["momenta"], strict=True):
            assert torch.equal(a, b)
        assert len(got["warnings"]) == 1
        assert "its step marked as an overflow" in got["warnings"][0]
