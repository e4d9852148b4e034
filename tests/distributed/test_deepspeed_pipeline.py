"""DeepSpeed's pipeline engine (2 stages × 2 data-parallel ranks, ZeRO 0):
kaisa runs in the optimizer's step pre-hook inside ``train_batch()``; each
stage preconditions its own layers with its data-parallel peer, the KL clip
sums over the stages, and the result equals one process training the whole
model on the whole batch."""

from __future__ import annotations

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


def pipeline_run(rank: int, world: int, kl_clip: float) -> dict[str, Any]:
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
    batches = iter(data(engine.grid.get_data_parallel_id()))
    for _ in range(STEPS):
        engine.train_batch(batches)
    return {
        "stage": engine.grid.get_stage_id(),
        "layers": sorted(precond.layers),
        "steps": precond.steps,
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
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
