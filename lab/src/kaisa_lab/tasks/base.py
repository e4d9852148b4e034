"""What a built-in training task is: data, model, loss, metric and defaults.

The command-line tool trains any task through this one interface, so a task
only says *what* to train; *how* (optimizer, K-FAC, timing, distribution) is the
CLI's job. Datasets are in-memory tensors indexed a whole batch at a time,
because per-sample ``Dataset.__getitem__`` plus collation costs more than the
forward pass of the small models used here.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from kaisa_lab.optim.build import BASELINE_LR, OPTIMIZERS
from kaisa_lab.tasks.tuned import Selection, selection

__all__ = [
    "OPTIMIZERS",
    "REQUIRED_OPTIMIZERS",
    "ArrayDataset",
    "BatchDataset",
    "Defaults",
    "EvalSums",
    "Metric",
    "Task",
    "TaskData",
    "arm_name",
    "bits_per_char",
]

#: Optimizers every task names a prior lr and a weight decay for; the others of
#: :data:`OPTIMIZERS` (today's baselines) fall back to
#: :data:`kaisa_lab.optim.BASELINE_LR` and the task's AdamW weight decay.
REQUIRED_OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")


def arm_name(optimizer: str, kfac: bool) -> str:
    """The suite's name of an arm: ``adamw`` or ``adamw+kfac``."""
    return f"{optimizer}+kfac" if kfac else optimizer


def bits_per_char(loss_nats: float) -> float:
    """Convert a mean cross-entropy in nats per character to bits per character."""
    return loss_nats / math.log(2.0)


class BatchDataset(Dataset[tuple[torch.Tensor, torch.Tensor]], abc.ABC):
    """A map-style dataset that is read one batch of indices at a time.

    It is a regular :class:`torch.utils.data.Dataset` (samplers and loaders
    accept it), but the CLI gathers whole batches with :meth:`get_batch`.
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples an epoch can draw from."""

    @abc.abstractmethod
    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, targets)`` for a 1-D int64 tensor of sample indices."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]


class ArrayDataset(BatchDataset):
    """Inputs and targets held as tensors whose first dimension is the sample.

    ``transform`` is applied to each gathered batch of inputs; it lets large
    datasets stay compact in memory (e.g. CIFAR-10 as uint8, 150 MB instead of
    600 MB as float32) and be normalised only when used.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"inputs and targets differ in length: {inputs.shape[0]} != {targets.shape[0]}"
            )
        self.inputs = inputs
        self.targets = targets
        self.transform = transform

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.inputs[indices]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[indices]


@dataclass(frozen=True)
class TaskData:
    """The fixed train/test (or validation) split of a task."""

    train: BatchDataset
    test: BatchDataset


@dataclass(frozen=True)
class Metric:
    """The evaluation metric that decides whether a run reached its target."""

    name: str
    higher_is_better: bool

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` is at least as good as ``target``."""
        return value >= target if self.higher_is_better else value <= target


@dataclass(frozen=True)
class Defaults:
    """How a task trains: its budget, its schedule's shape and each optimizer's prior.

    ``lr`` and ``weight_decay`` are per optimizer because a good step size for
    SGD is one to two orders of magnitude larger than for Adam. ``lr`` is a
    *prior*: the centre of the benchmark suite's lr grid for the optimizer,
    and the lr an arm runs at until the suite has selected one from runs
    (:meth:`Task.arm`; :mod:`kaisa_lab.tasks.tuned`). An optimizer left out of
    ``lr`` takes its library's documented lr
    (:data:`kaisa_lab.optim.BASELINE_LR`); left out of ``weight_decay``, the
    task's AdamW weight decay (decoupled, as AdamW's). ``muon``'s AdamW part
    (embeddings, head, norms, biases) runs at the task's ``adamw`` prior and
    weight decay.

    ``optimizer`` is what ``--optimizer`` defaults to. ``steps_per_epoch``
    caps an epoch for tasks whose natural epoch is too long to evaluate at a
    useful rate (language modelling samples windows); ``evals_per_epoch`` is
    how often the metric is read within an epoch: time to target can be no
    finer than it. ``schedule`` (``constant`` or ``cosine``) and
    ``warmup_epochs`` shape the learning rate of every arm alike
    (:mod:`kaisa_lab.cli.schedule`), except where the suite selected an
    arm's own warm-up. K-FAC runs at the library's defaults unless the suite
    selected knobs for it.
    """

    epochs: int
    batch_size: int
    lr: Mapping[str, float]
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: Mapping[str, float] = field(
        default_factory=lambda: {"sgd": 0.0, "adam": 0.0, "adamw": 0.01}
    )
    steps_per_epoch: int | None = None
    eval_batch_size: int = 512
    evals_per_epoch: int = 1
    schedule: str = "constant"
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        for name, mapping in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            if set(mapping) - set(OPTIMIZERS):
                raise ValueError(
                    f"Defaults.{name} may name only {', '.join(OPTIMIZERS)}; got {sorted(mapping)}"
                )

    def base_lr(self, optimizer: str) -> float:
        """The prior lr of ``optimizer``: the task's, else its library's."""
        return float(self.lr[optimizer] if optimizer in self.lr else BASELINE_LR[optimizer])

    def decay(self, optimizer: str) -> float:
        """The weight decay of ``optimizer``: the task's, else the task's AdamW one."""
        return float(self.weight_decay.get(optimizer, self.weight_decay["adamw"]))


@dataclass
class EvalSums:
    """Additive evaluation statistics, so shards from several ranks can be summed."""

    loss_sum: float = 0.0
    correct: float = 0.0
    count: float = 0.0

    def as_tensor(self) -> torch.Tensor:
        """Pack as float64 so one all-reduce sums them without precision loss."""
        return torch.tensor([self.loss_sum, self.correct, self.count], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> EvalSums:
        loss_sum, correct, count = (float(v) for v in t.tolist())
        return cls(loss_sum, correct, count)


class Task(abc.ABC):
    """A built-in training task: classification of samples or of tokens.

    Subclasses set the class attributes and implement :meth:`load` and
    :meth:`build_model`. The model returns logits whose last dimension is the
    class (or vocabulary) dimension; targets have the same shape without it.
    This covers image classification and next-token prediction with one loss
    and one evaluation routine.
    """

    name: str
    description: str
    metric: Metric
    target: float
    defaults: Defaults
    #: How the training loss is averaged (a :class:`kaisa.LossAverage` value);
    #: K-FAC needs it to scale the output-gradient factor correctly.
    loss_average: str = "batch"

    @abc.abstractmethod
    def load(self, data_dir: Path | None = None) -> TaskData:
        """Load (or build) the fixed train/test split."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (seed the global RNG first for reproducibility)."""

    def tuned(self, arm: str) -> Selection | None:
        """The benchmark suite's selection for ``arm`` (``adamw``, ``adamw+kfac``, ...)."""
        return selection(self.name, arm)

    def lr_tuned(self, optimizer: str, kfac: bool = False) -> bool:
        """Whether the suite selected this arm's lr from runs (else it runs at the prior)."""
        return self.tuned(arm_name(optimizer, kfac)) is not None

    def arm(self, kfac: bool, optimizer: str) -> tuple[float, str, float]:
        """``(lr, schedule, warmup_epochs)`` of the arm: the suite's selection, else the
        prior lr at the task's schedule and warm-up."""
        chosen = self.tuned(arm_name(optimizer, kfac))
        if chosen is not None:
            return chosen.lr, chosen.schedule, chosen.warmup_epochs
        d = self.defaults
        return d.base_lr(optimizer), d.schedule, float(d.warmup_epochs)

    def kfac_for(self, optimizer: str) -> dict[str, Any]:
        """K-FAC's keywords for the K-FAC arm on ``optimizer`` besides the library's
        defaults: those the suite selected for it (none at the library's defaults)."""
        chosen = self.tuned(arm_name(optimizer, True))
        return dict(chosen.kfac) if chosen is not None else {}

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every sample (and token)."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    @torch.no_grad()
    def eval_sums(self, output: torch.Tensor, target: torch.Tensor) -> EvalSums:
        """Summed loss, correct predictions and count for one evaluation batch."""
        logits = output.reshape(-1, output.shape[-1])
        labels = target.reshape(-1)
        loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(dim=-1) == labels).sum()
        return EvalSums(float(loss_sum), float(correct), float(labels.numel()))

    def summarize(self, sums: EvalSums) -> dict[str, float]:
        """Turn summed statistics into named metrics; must contain ``metric.name``."""
        if sums.count <= 0:
            raise ValueError("cannot summarise an evaluation over zero samples")
        return {"loss": sums.loss_sum / sums.count, "accuracy": sums.correct / sums.count}
