"""A step with non-finite gradients under DeepSpeed is skipped, update
included: weights and optimizer state end bit-identical to a loop that left
the bad batch out, on 2 gloo ranks.  ZeRO's optimizers and the bf16 wrapper
skip it by their own check; a plain torch optimizer (ZeRO 0 in fp32, and
the pipeline engine) checks nothing, so kaisa takes its gradients away and
marks the step an overflow, which DeepSpeed counts in ``skipped_steps``."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kaisa import KFACPreconditioner

from deepspeed_case import (
    ACCUMULATE,
    KW,
    config,
    deepspeed_or_skip,
    full_parameters,
    join,
    make_net,
    make_optimizer,
    micro_batches,
)
from harness import run_distributed

pytestmark = pytest.mark.distributed
deepspeed_or_skip()

TIMEOUT = dict(timeout_s=400, pg_timeout_s=300)
BAD = 1  # the optimizer step whose first micro-batch is NaN on rank 0


def _optimizer_state(engine: Any) -> list[torch.Tensor]:
    """The tensors of the torch optimizer DeepSpeed steps (inside its wrapper
    where it has one), in the order they were created (ZeRO 3 keys them by
    partitions its parameter groups no longer list)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return [
        value.detach().float().clone()
        for entry in inner.state.values()
        for _, value in sorted(entry.items())
        if isinstance(value, torch.Tensor)
    ]


def _run(rank: int, world: int, cfg: dict, loop_skips: bool) -> dict[str, Any]:
    deepspeed = join(rank, world)
    net = make_net()
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=make_optimizer(net), config=cfg, dist_init_required=False
    )
    precond = KFACPreconditioner(engine, **KW)
    dtype = torch.bfloat16 if cfg.get("bf16") else torch.float32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(micro_batches(rank)):
            if i // ACCUMULATE == BAD and loop_skips:
                continue
            loss = F.cross_entropy(engine(x.to(dtype)).float(), y)
            if i == BAD * ACCUMULATE and rank == 0:
                loss = loss * float("nan")
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                precond.step()
            engine.step()
    return {
        "params": full_parameters(engine),
        "state": _optimizer_state(engine),
        "steps": precond.steps,
        "skipped": engine.skipped_steps,
        "optimizer": type(engine.optimizer).__name__,
        "warnings": [str(w.message) for w in caught if "non-finite" in str(w.message)],
    }


def _both(rank: int, world: int, cfg: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    return _run(rank, world, cfg, loop_skips=False), _run(rank, world, cfg, loop_skips=True)


@pytest.mark.parametrize(
    ("stage", "bf16", "optimizer", "words"),
    [
        (0, False, "SGD", "its step marked as an overflow"),
        (0, True, "FP16_UnfusedOptimizer", "finds the non-finite gradients itself"),
        (2, False, "DeepSpeedZeroOptimizer", "finds the non-finite gradients itself"),
        (3, True, "DeepSpeedZeroOptimizer_Stage3", "finds the non-finite gradients itself"),
    ],
    ids=["zero0-fp32", "zero0-bf16", "zero2-fp32", "zero3-bf16"],
)
def test_a_skipped_step_changes_no_weight_and_no_state(
    stage: int, bf16: bool, optimizer: str, words: str
) -> None:
    for rank, (got, want) in enumerate(
        run_distributed(2, _both, config(stage, bf16=bf16), **TIMEOUT)
    ):
        assert got["optimizer"] == optimizer
        assert got["skipped"] == 1 and want["skipped"] == 0, (got["skipped"], want["skipped"])
        assert got["steps"] == want["steps"] == 3
        for a, b in zip(got["params"], want["params"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: the weights moved"
        assert got["state"] and len(got["state"]) == len(want["state"])
        for a, b in zip(got["state"], want["state"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: the optimizer state moved"
        assert len(got["warnings"]) == 1 and words in got["warnings"][0], got["warnings"]
        assert "engine.skipped_steps" in got["warnings"][0]
