"""DeepSpeed on forked gloo ranks: environment, a config, and the two loops
every DeepSpeed test compares (DeepSpeed with kaisa, and plain DDP with kaisa).

DeepSpeed compiles a small C++ op on its first start (60–80 s) into
``TORCH_EXTENSIONS_DIR``; a lock left by a killed build hangs every later
start, so the tests use a private directory and clear stale locks first.
"""

from __future__ import annotations

import logging
import os
import pathlib
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa import KFACPreconditioner
from kfac_defaults import kfac_pytorch

EXTENSIONS = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"
# kfac-pytorch's options (the eigen method, factors every step): the bf16 run
# tracks the fp32 DDP run within 1/20 of K-FAC's effect with eigen, not inverse
KW: dict[str, Any] = kfac_pytorch(damping=0.01, kl_clip=0.05, inv_update_steps=2)
ACCUMULATE = 2
STEPS = 4
BATCH = 4


def prepare_environment() -> None:
    """Select DeepSpeed's CPU accelerator and a private extension cache."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))
    root = pathlib.Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    for lock in root.rglob("lock"):
        if time.time() - lock.stat().st_mtime > 600:  # no build takes 10 minutes
            lock.unlink(missing_ok=True)


def deepspeed_or_skip() -> Any:
    prepare_environment()
    return pytest.importorskip("deepspeed", reason="deepspeed is not installed (kaisa[deepspeed])")


def make_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3, bias=False)
    ).to(dtype)


def micro_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(STEPS * ACCUMULATE)
    ]


def config(stage: int, *, bf16: bool = False, fp16: bool = False, clip: float = 0.0) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": ACCUMULATE,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if fp16:
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def join(rank: int, world: int) -> Any:
    """DeepSpeed joins the harness's process group (it needs LOCAL_RANK)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    return deepspeed


def deepspeed_run(
    rank: int, world: int, cfg: dict, fraction: float = 1.0, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """DeepSpeed with kaisa; the returned ``params`` are full fp32 tensors."""
    deepspeed = join(rank, world)
    net = make_net()
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=make_optimizer(net), config=cfg, dist_init_required=False
    )
    precond = KFACPreconditioner(engine, grad_worker_fraction=fraction, **KW)
    losses = []
    for i, (x, y) in enumerate(micro_batches(rank)):
        loss = F.cross_entropy(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            precond.step()
        engine.step()
        if i % ACCUMULATE == 0:
            losses.append(float(loss))
    params = full_parameters(engine)
    return {"params": params, "losses": losses, "steps": precond.steps, "engine": "ok"}


def full_parameters(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            out.append(safe_get_full_fp32_param(p).detach().clone())
        else:
            out.append(p.detach().float().clone())
    return out


def ddp_run(rank: int, world: int, clip: float = 0.0, kfac: bool = True) -> dict[str, Any]:
    """The plain DDP loop with kaisa on the same data (loss divided by the
    accumulation count, as DeepSpeed does); ``clip`` clips after kaisa."""
    net = make_net()
    ddp = DistributedDataParallel(net)
    opt = make_optimizer(net)
    precond = KFACPreconditioner(ddp, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    if not kfac:
        precond.remove_hooks()
    mine = micro_batches(rank)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        chunk = mine[step * ACCUMULATE : (step + 1) * ACCUMULATE]
        for i, (x, y) in enumerate(chunk):
            loss = F.cross_entropy(ddp(x), y) / ACCUMULATE
            if i < len(chunk) - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if kfac:
            precond.step()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
    return {"params": [p.detach().clone() for p in net.parameters()], "norms": norms}


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [float((a.float() - b).norm() / b.norm()) for a, b in zip(got, want)]
