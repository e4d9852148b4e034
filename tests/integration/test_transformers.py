"""The Hugging Face Trainer's KFACCallback gives the parameters of the plain loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from kaisa import KFACPreconditioner  # noqa: E402
from kaisa.integrations.transformers import KFACCallback  # noqa: E402

KW = dict(damping=0.01, kl_clip=0.05, inv_update_steps=2)
ACCUMULATE = 2
STEPS = 3
BATCH = 4


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(self.net(x), labels)}


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * ACCUMULATE * BATCH
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


class InOrder(transformers.Trainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def plain_loop() -> list[torch.Tensor]:
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, accumulation_steps=ACCUMULATE, **KW)
    data = rows()
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(ACCUMULATE):
            start = (step * ACCUMULATE + k) * BATCH
            chunk = data[start : start + BATCH]
            x = torch.stack([r["x"] for r in chunk])
            y = torch.stack([r["labels"] for r in chunk])
            (model(x, y)["loss"] / ACCUMULATE).backward()
        precond.step()
        opt.step()
    return [p.detach() for p in model.parameters()]


def trainer_run(tmp_path, max_grad_norm: float) -> tuple[list[torch.Tensor], KFACCallback]:
    model = Classifier()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        weight_decay=0.0,
        max_grad_norm=max_grad_norm,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    callback = KFACCallback(**KW)
    InOrder(model=model, args=args, train_dataset=rows(), callbacks=[callback]).train()
    return [p.detach() for p in model.parameters()], callback


def test_trainer_callback_equals_plain_loop_with_accumulation(tmp_path) -> None:
    got, callback = trainer_run(tmp_path, max_grad_norm=0.0)
    assert callback.preconditioner is not None and callback.preconditioner.steps == STEPS
    for a, b in zip(got, plain_loop()):
        assert float((a - b).norm() / b.norm()) <= 1e-5  # float32


def test_trainer_clipping_before_kfac_warns(tmp_path) -> None:
    with pytest.warns(UserWarning, match="max_grad_norm=1.0"):
        trainer_run(tmp_path, max_grad_norm=1.0)
