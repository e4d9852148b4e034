"""Lightning under DDP on 2 gloo ranks equals the plain DDP loop with kaisa."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed")

from kaisa.integrations.lightning import KFACCallback  # noqa: E402

from framework_case import (  # noqa: E402
    ACCUMULATE,
    KW,
    STEPS,
    assert_close,
    ddp_loop,
    micro_batches,
)
from harness import run_distributed  # noqa: E402
from lightning_case import Module  # noqa: E402

pytestmark = pytest.mark.distributed


class Sharded(Module):
    """The same module, sharded with FSDP2 by Lightning's ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def lightning_run(rank: int, strategy: str = "ddp") -> list[torch.Tensor]:
    # The process group exists already: Lightning joins it instead of launching
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    module = Module() if strategy == "ddp" else Sharded()
    chosen: Any = strategy
    if strategy == "fsdp2":
        chosen = pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=2,
            strategy=chosen,
            # ModelParallelStrategy refuses "64-true"; "32-true" keeps the float64 net
            precision="64-true" if strategy == "ddp" else "32-true",
            accumulate_grad_batches=ACCUMULATE,
            callbacks=[callback := KFACCallback(**KW)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            use_distributed_sampler=False,  # each rank loads its own shard, as below
        )
        shard = micro_batches(2 * STEPS * ACCUMULATE)[rank::2]
        loader = torch.utils.data.DataLoader(shard, batch_size=None, shuffle=False)
        trainer.fit(module, loader)
    assert callback.preconditioner is not None
    assert callback.preconditioner._parts.engine.name == ("torch" if strategy == "ddp" else "fsdp2")
    params = [p.detach() for p in module.net.parameters()]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.clone() for p in params]


def both(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return lightning_run(rank), ddp_loop(rank, world)


def test_lightning_ddp_with_accumulation_equals_plain_ddp_loop() -> None:
    for got, want in run_distributed(2, both, timeout_s=120):
        assert_close(got, want)


def sharded_both(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return lightning_run(rank, "fsdp2"), ddp_loop(rank, world)


def test_lightning_model_parallel_fsdp2_equals_plain_ddp_loop() -> None:
    """ModelParallelStrategy (FSDP2, data_parallel_size=2) with accumulation: the
    callback finds the sharded model's engine and equals the plain DDP loop."""
    for got, want in run_distributed(2, sharded_both, timeout_s=120):
        assert got[0].dtype == torch.float64  # "32-true" leaves the float64 net as it is
        assert_close(got, want)
