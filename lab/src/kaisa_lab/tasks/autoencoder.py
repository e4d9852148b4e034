"""A deep autoencoder on the 8×8 digits.

Deep autoencoders are the classic hard case for first-order methods (long
chains of saturating units, a regression loss) and the benchmark of the
original K-FAC paper (Martens & Grosse, 2015).

The loss is the squared error summed over the 64 pixels and averaged over the
images (``loss_average='batch'``: one data point per image), so its gradient
scale does not depend on the number of pixels; the metric is the test
reconstruction error per pixel on standardised pixels (0 perfect, 1 the
error of predicting the mean image's value everywhere, roughly).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from torch import nn

from kaisa_lab.tasks.base import ArrayDataset, Defaults, EvalSums, Metric, Task, TaskData
from kaisa_lab.tasks.digits import load_digits_split

__all__ = ["DigitsAutoencoderTask"]

PIXELS = 64


class DigitsAutoencoderTask(Task):
    """Tanh autoencoder 64-256-128-32-8-32-128-256-64 on flattened digits."""

    name = "digits-ae"
    description = (
        "deep tanh autoencoder 64-256-128-32-8-32-128-256-64 on scikit-learn digits, "
        "scored by test reconstruction error per pixel"
    )
    metric = Metric("mse", higher_is_better=False)
    target = 0.12
    # The metric is read after every step (23 an epoch, off the clock), so
    # time to target is not rounded up to an epoch's end.
    defaults = Defaults(
        epochs=30,
        batch_size=64,
        evals_per_epoch=23,
        lr={"sgd": 0.01, "adam": 0.003, "adamw": 0.003},
        weight_decay={"sgd": 0.0, "adam": 0.0, "adamw": 0.0},
    )

    widths = (256, 128, 32, 8)

    def load(self, data_dir: Path | None = None) -> TaskData:
        x_train, _, x_test, _ = load_digits_split()
        train, test = x_train.flatten(1), x_test.flatten(1)
        return TaskData(train=ArrayDataset(train, train), test=ArrayDataset(test, test))

    def build_model(self) -> nn.Module:
        sizes = (PIXELS, *self.widths, *reversed(self.widths[:-1]), PIXELS)
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(itertools.pairwise(sizes)):
            layers.append(nn.Linear(d_in, d_out))
            # no squashing at the code (a linear bottleneck) or at the output
            if i not in (len(self.widths) - 1, len(sizes) - 2):
                layers.append(nn.Tanh())
        return nn.Sequential(*layers)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Squared error summed over pixels, averaged over images."""
        return (output - target).square().sum(-1).mean()

    @torch.no_grad()
    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> EvalSums:
        """Summed squared error and the number of pixels it is summed over."""
        sq = (output.float() - target.float()).square().sum()
        return EvalSums(float(sq), 0.0, float(target.numel()))

    def summarize(self, sums: EvalSums) -> dict[str, float]:
        if sums.count <= 0:
            raise ValueError("cannot summarise an evaluation over zero samples")
        mse = sums.loss_sum / sums.count
        return {"loss": mse * PIXELS, "mse": mse}
