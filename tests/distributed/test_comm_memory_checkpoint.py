"""Communication accounting, per-rank memory, checkpoints across world sizes, timeouts."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.distributed.communicator import CommunicationError
from kfac_defaults import kfac_pytorch

from harness import run_distributed
from test_invariance import B, make_model, rel

pytestmark = pytest.mark.distributed

WIDTH = 16
DEPTH = 8


def wide_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def run_wide(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for config in configs:
        model = wide_model()
        precond = KFACPreconditioner(
            model, lr=0.1, damping=0.01, factor_update_steps=1, inv_update_steps=3, **config
        )
        out.append(record_steps(model, precond, rank, world, 4, B, WIDTH))
    return out


def record_steps(
    model: nn.Module,
    precond: KFACPreconditioner,
    rank: int,
    world: int,
    steps: int,
    batch: int,
    width: int,
) -> dict[str, Any]:
    """Each step's traffic and memory on this rank, gradients averaged by hand
    (an MSE regression to zero on ``[batch, width]`` rows of this rank's seed)."""
    g = torch.Generator().manual_seed(rank)
    record: dict[str, Any] = {"comm": [], "memory": []}
    for _ in range(steps):
        model.zero_grad()
        x = torch.randn(batch, width, generator=g, dtype=torch.float64)
        F.mse_loss(model(x), torch.zeros_like(x)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        precond.step()
        record["comm"].append(precond.comm_stats()["step"])
        record["memory"].append(precond.memory_usage())
    return record


def bytes_of(step: dict[str, dict[str, int]], kind: str) -> int:
    return step.get(kind, {}).get("bytes", 0)


def test_communication_and_memory_per_strategy() -> None:
    configs = [
        dict(grad_worker_fraction=1.0),  # 0 COMM-OPT
        dict(grad_worker_fraction=0.5),  # 1 HYBRID-OPT
        dict(grad_worker_fraction=0.0),  # 2 MEM-OPT
        dict(grad_worker_fraction=1.0, symmetry_aware=True),  # 3
        dict(grad_worker_fraction=1.0, allreduce_bucket_cap_mb=0),  # 4
    ]
    results = run_distributed(4, run_wide, configs)
    a, g = WIDTH + 1, WIDTH
    f64 = 8
    for per_rank in results:
        comm_opt, hybrid, mem_opt, sym, unbucketed = per_rank
        # step 0 and 3 are inverse-update steps, 1 and 2 are not
        for step in (1, 2):
            assert bytes_of(comm_opt["comm"][step], "second_order_broadcast") == 0
            assert bytes_of(comm_opt["comm"][step], "grad_broadcast") == 0
            assert bytes_of(hybrid["comm"][step], "second_order_broadcast") == 0
            assert bytes_of(mem_opt["comm"][step], "grad_broadcast") > 0
            assert bytes_of(hybrid["comm"][step], "grad_broadcast") > 0
        assert bytes_of(comm_opt["comm"][0], "second_order_broadcast") > 0
        assert (
            bytes_of(mem_opt["comm"][0], "second_order_broadcast") == 0
        )  # one worker: nothing to send
        # every rank contributes every factor once per factor step
        full = DEPTH * (a * a + g * g) * f64
        assert bytes_of(comm_opt["comm"][1], "factor_reduce") == full
        assert (
            bytes_of(sym["comm"][1], "factor_reduce")
            == DEPTH * (a * (a + 1) // 2 + g * (g + 1) // 2) * f64
        )
        # bucketing: one call per owner rank; without, one per factor
        assert comm_opt["comm"][1]["factor_reduce"]["calls"] <= 4
        assert unbucketed["comm"][1]["factor_reduce"]["calls"] == 2 * DEPTH
        # memory: MEM-OPT keeps 1/W of COMM-OPT's second-order tensors; HYBRID 2/W
        so = {
            name: r["memory"][-1]["second_order"]
            for name, r in (("comm", comm_opt), ("hybrid", hybrid), ("mem", mem_opt))
        }
        assert so["mem"] * 4 == so["comm"]
        assert so["hybrid"] * 2 == so["comm"]
    # factors are kept by their owners only: no rank duplicates another's
    for idx in range(3):
        total = sum(results[r][idx]["memory"][-1]["factors"] for r in range(4))
        assert total == DEPTH * (a * a + g * g) * f64


# -- checkpoints ---------------------------------------------------------------------------

TOTAL_STEPS = 6
# factors every step (kfac-pytorch's): a factors-only checkpoint resumes on
# factors that moved after the cut, so only the default one is exact
KW = kfac_pytorch(damping=0.01, kl_clip=0.05, inv_update_steps=2)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(4 * B, 2, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (4 * B,), generator=g),
        )
        for _ in range(TOTAL_STEPS)
    ]


def steps(model, opt, precond, rank, world, first, last, record) -> None:
    share = 4 * B // world
    for i in range(first, last):
        x, y = global_batches()[i]
        opt.zero_grad()
        F.cross_entropy(
            model(x[rank * share : (rank + 1) * share]), y[rank * share : (rank + 1) * share]
        ).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        record.append([p.grad.clone() for p in model.parameters()])
        opt.step()


def make_run(fraction: float):
    model = make_model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, grad_worker_fraction=fraction, **KW)
    return model, opt, precond


def take_checkpoints(rank: int, world: int) -> dict[str, Any]:
    model, opt, precond = make_run(0.5)
    record: list = []
    steps(model, opt, precond, rank, world, 0, 3, record)
    with_so = {
        "kfac": precond.state_dict(include_second_order=True),
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
    }
    steps(model, opt, precond, rank, world, 3, 4, record)
    factors_only = {
        "kfac": precond.state_dict(include_second_order=False),
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
    }
    return {"with_so": with_so, "factors_only": factors_only}


def resume(
    rank: int, world: int, ckpt: dict[str, Any], fraction: float, start: int
) -> dict[str, Any]:
    model, opt, precond = make_run(fraction)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    precond.load_state_dict(ckpt["kfac"])
    assert precond.steps == start
    held = {}
    for name, layer in precond.layers.items():
        lp = precond.plan.layer(name)
        held[name] = dict(
            A=layer.factor("A") is not None,
            G=layer.factor("G") is not None,
            so=bool(layer.state),
            a_owner=lp.owner_of("A") == rank,
            g_owner=lp.owner_of("G") == rank,
            worker=rank in lp.grad_workers,
        )
    record: list = []
    steps(model, opt, precond, rank, world, start, TOTAL_STEPS, record)
    decomposed = {
        name: (layer.decompositions, precond.plan.layer(name).is_decomposer(rank))
        for name, layer in precond.layers.items()
    }
    return {
        "grads": record,
        "params": [p.detach().clone() for p in model.parameters()],
        "held": held,
        "decomposed": decomposed,
    }


def test_checkpoint_from_w4_hybrid_loads_anywhere() -> None:
    ckpts = run_distributed(4, take_checkpoints)[0]
    # the uninterrupted reference: one process on the full batches
    model, opt, precond = make_run(1.0)
    ref: list = []
    steps(model, opt, precond, 0, 1, 0, TOTAL_STEPS, ref)
    ref_params = [p.detach().clone() for p in model.parameters()]
    for world, fraction in [(4, 1.0), (4, 0.0), (4, 0.5), (2, 0.5), (2, 0.0), (1, 1.0)]:
        for key, start in (("with_so", 3), ("factors_only", 4)):
            if world == 1:
                results = [resume(0, 1, ckpts[key], fraction, start)]
            else:
                results = run_distributed(world, resume, ckpts[key], fraction, start)
            for rank, got in enumerate(results):
                what = f"W={world} f={fraction} {key} rank {rank}"
                for i, (g_got, g_ref) in enumerate(zip(got["grads"], ref[start:])):
                    for a, b in zip(g_got, g_ref):
                        assert rel(a, b) <= 1e-10, f"{what}: step {start + i}"
                for a, b in zip(got["params"], ref_params):
                    assert rel(a, b) <= 1e-10, what
                for name, h in got["held"].items():
                    assert h["A"] == h["a_owner"] and h["G"] == h["g_owner"], (what, name, h)
                    assert h["so"] == (h["worker"] and key == "with_so"), (what, name, h)
                for name, (count, owner) in got["decomposed"].items():
                    if not owner:
                        assert count == 0, (what, name)


# -- failure -------------------------------------------------------------------------------


def absent_rank(rank: int, world: int) -> dict[str, Any]:
    model = make_model(torch.float64)
    precond = KFACPreconditioner(model, pg_timeout_s=2.0)
    x = torch.randn(B, 2, 6, 6, dtype=torch.float64)
    F.cross_entropy(model(x), torch.zeros(B, dtype=torch.long)).backward()
    if rank == 1:
        time.sleep(6)  # never reaches step()
        return {}
    start = time.monotonic()
    try:
        precond.step()
    except CommunicationError as exc:
        return {"elapsed": time.monotonic() - start, "message": str(exc)}
    return {"elapsed": time.monotonic() - start, "message": None}


def test_absent_rank_fails_clearly_within_timeout() -> None:
    result = run_distributed(2, absent_rank, timeout_s=60)[0]
    assert result["message"] is not None, "step() returned although rank 1 never arrived"
    assert "never reached this preconditioner step" in result["message"]
    assert result["elapsed"] < 5.5


def group_timeout(rank: int, world: int) -> float | None:
    precond = KFACPreconditioner(make_model(torch.float64))
    return precond.comm.timeout_s


def test_groups_inherit_the_init_process_group_timeout() -> None:
    # the harness initialises the default group with pg_timeout_s=7
    assert run_distributed(2, group_timeout, pg_timeout_s=7.0) == [7.0, 7.0]


def launched_during_backward(rank: int, world: int) -> list[int]:
    counts = []
    for in_hook in (True, False):
        model = wide_model()
        precond = KFACPreconditioner(
            model, allreduce_bucket_cap_mb=0, update_factors_in_hook=in_hook
        )
        x = torch.randn(B, WIDTH, dtype=torch.float64)
        F.mse_loss(model(x), torch.zeros_like(x)).backward()
        counts.append(len(precond.comm._launched))  # in flight before step()
        precond.step()
    return counts


def test_factor_reduction_overlaps_backward() -> None:
    # With hooks, each layer's reduction is launched as soon as its output
    # gradient arrives; without, nothing is sent before step().
    for counts in run_distributed(2, launched_during_backward):
        assert counts == [2 * DEPTH, 0]
