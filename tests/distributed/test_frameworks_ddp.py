"""accelerate and the Hugging Face Trainer on 2 gloo ranks (DDP underneath,
gradient accumulation 2) equal the plain DDP loop with kaisa."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from framework_case import (
    ACCUMULATE,
    KW,
    STEPS,
    accelerate_recipe,
    assert_close,
    ddp_loop,
    make_net,
    make_optimizer,
    micro_batches,
)
from harness import run_distributed

pytestmark = pytest.mark.distributed


def join(rank: int, world: int) -> None:
    """The process group exists: the frameworks find it through the usual env."""
    os.environ.update(
        LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1"
    )
    os.environ.setdefault("MASTER_PORT", "29561")
    # a one-process accelerate state forked from the test process would stick
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def accelerate_run(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    join(rank, world)
    import accelerate

    mine = micro_batches(world * STEPS * ACCUMULATE)[rank::world]
    return accelerate_recipe(accelerate, mine), ddp_loop(rank, world)


def test_accelerate_two_ranks_equal_ddp_loop() -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    for got, want in run_distributed(2, accelerate_run):
        assert_close(got, want)


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


def trainer_run(rank: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    join(rank, world)
    import transformers

    from kaisa.integrations.transformers import KFACCallback

    # the Trainer gives rank r every world-th batch of the sampler's order
    batches = micro_batches(world * STEPS * ACCUMULATE)
    rows = [{"x": x[i], "labels": y[i]} for x, y in batches for i in range(len(y))]

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            self.optimizer = make_optimizer(self.model)
            return self.optimizer

    model = Classifier()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=len(batches[0][1]),
            gradient_accumulation_steps=ACCUMULATE,
            max_steps=STEPS,
            learning_rate=0.1,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            report_to=[],
            use_cpu=True,
            ddp_backend="gloo",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        )
        callback = KFACCallback(**KW)
        trainer = InOrder(model=model, args=args, train_dataset=rows, callbacks=[callback])
        assert trainer.args.world_size == world
        trainer.train()
    assert callback.preconditioner is not None and callback.preconditioner.steps == STEPS
    return [p.detach().clone() for p in model.net.parameters()], ddp_loop(rank, world)


def test_hf_trainer_two_ranks_equal_ddp_loop() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="accelerate is not installed (the Trainer needs it)")
    for got, want in run_distributed(2, trainer_run):
        assert_close(got, want)
