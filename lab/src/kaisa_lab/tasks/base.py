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

__all__ = [
    "KFAC_ARM_KEYS",
    "OPTIMIZERS",
    "REQUIRED_OPTIMIZERS",
    "ArrayDataset",
    "BatchDataset",
    "Defaults",
    "EvalSums",
    "Metric",
    "Task",
    "TaskData",
    "bits_per_char",
]

#: Optimizers every task names a learning rate and weight decay for; the
#: others of :data:`OPTIMIZERS` (today's baselines) fall back to
#: :data:`kaisa_lab.optim.BASELINE_LR` and the task's AdamW weight decay
#: where a task has not tuned them (:meth:`Defaults.lr_tuned`).
REQUIRED_OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")

#: What :attr:`Defaults.kfac_arm` may set for the K-FAC arm alone (``lr``
#: per optimizer, as :attr:`Defaults.lr`).
KFAC_ARM_KEYS: tuple[str, ...] = ("lr", "schedule", "warmup_epochs", "kfac")


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
    """Hyperparameters a task trains well with, used unless overridden.

    ``optimizer`` is what ``--optimizer`` defaults to (SGD trains small
    Transformers poorly, so the language model defaults to Adam). ``lr`` and
    ``weight_decay`` are per optimizer because a good step size for SGD is one
    to two orders of magnitude larger than for Adam. ``kfac`` holds
    :class:`kaisa.KFACConfig` keywords; ``lr`` should not be among them so that
    the preconditioner follows the optimizer's learning rate.
    ``steps_per_epoch`` caps an epoch for tasks whose natural epoch is too long
    to evaluate at a useful rate (language modelling samples windows).
    ``evals_per_epoch`` is how often the metric is read within an epoch: time
    to target can be no finer than it.
    ``schedule`` (``constant`` or ``cosine``) and ``warmup_epochs`` shape the
    learning rate of both arms (see :mod:`kaisa_lab.cli.schedule`); a tuned
    baseline usually needs them, and K-FAC must be compared with that baseline.
    ``kfac_arm`` overrides ``lr`` (per optimizer, like ``lr``), ``schedule``
    and/or ``warmup_epochs`` for the K-FAC arm alone: each arm is tuned on its
    own, and a preconditioned optimizer may want another step size or no
    warm-up where its first-order baseline needs one (text-lm, text-cnn).

    Today's baselines (``muon``, ``soap``, ``shampoo``, ``lamb``) may be left
    out of ``lr`` and ``weight_decay``: they then run at their library's
    documented lr (:data:`kaisa_lab.optim.BASELINE_LR`) and the task's AdamW
    weight decay (all four decay weights decoupled, as AdamW does), and
    :meth:`lr_tuned` says so, so ``kaisa compare`` can warn that such an arm
    was not tuned for the task. ``muon``'s AdamW part (embeddings, head,
    norms, biases) runs at the task's ``adamw`` lr and weight decay.
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
    kfac: Mapping[str, Any] = field(default_factory=dict)
    schedule: str = "constant"
    warmup_epochs: float = 0.0
    #: the first-order arm's warm-up for the optimizers named, where one was
    #: tuned apart (Muon on text-lm needs none); the others take ``warmup_epochs``
    warmup_by_optimizer: Mapping[str, float] = field(default_factory=dict)
    kfac_arm: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, mapping in (("lr", self.lr), ("weight_decay", self.weight_decay)):
            if set(mapping) - set(OPTIMIZERS):
                raise ValueError(
                    f"Defaults.{name} may name only {', '.join(OPTIMIZERS)}; got {sorted(mapping)}"
                )
        unknown = set(self.kfac_arm) - set(KFAC_ARM_KEYS)
        if unknown:
            raise ValueError(
                f"Defaults.kfac_arm may set only {', '.join(KFAC_ARM_KEYS)}; got "
                f"{', '.join(sorted(unknown))}"
            )
        if set(self.warmup_by_optimizer) - set(OPTIMIZERS) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
            for v in self.warmup_by_optimizer.values()
        ):
            raise ValueError(
                f"Defaults.warmup_by_optimizer must map optimizer names ({', '.join(OPTIMIZERS)}) "
                f"to warm-up epochs >= 0; got {self.warmup_by_optimizer!r}"
            )
        per_optimizer = self.kfac_arm.get("kfac", {})
        if not isinstance(per_optimizer, Mapping) or not all(
            name in OPTIMIZERS and isinstance(options, Mapping)
            for name, options in per_optimizer.items()
        ):
            raise ValueError(
                "Defaults.kfac_arm['kfac'] must map optimizer names "
                f"({', '.join(OPTIMIZERS)}) to K-FAC keyword mappings; got {per_optimizer!r}"
            )
        arm_lr = self.kfac_arm.get("lr", {})
        if not isinstance(arm_lr, Mapping) or not all(
            name in OPTIMIZERS
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
            and v > 0
            for name, v in arm_lr.items()
        ):
            raise ValueError(
                "Defaults.kfac_arm['lr'] must map optimizer names "
                f"({', '.join(OPTIMIZERS)}) to positive learning rates; got {arm_lr!r}"
            )

    def lr_tuned(self, optimizer: str) -> bool:
        """Whether the task names an lr for ``optimizer`` (else the library's is used)."""
        return optimizer in self.lr

    def base_lr(self, optimizer: str) -> float:
        """The first-order lr of ``optimizer``: the task's, else its library's."""
        return float(self.lr[optimizer] if optimizer in self.lr else BASELINE_LR[optimizer])

    def decay(self, optimizer: str) -> float:
        """The weight decay of ``optimizer``: the task's, else the task's AdamW one."""
        return float(self.weight_decay.get(optimizer, self.weight_decay["adamw"]))

    def kfac_for(self, optimizer: str) -> dict[str, Any]:
        """The K-FAC keywords of the K-FAC arm on ``optimizer``: the task's
        ``kfac``, updated by ``kfac_arm['kfac'][optimizer]`` where the task tuned
        K-FAC on that optimizer apart (e.g. longer intervals under Muon)."""
        return {**self.kfac, **self.kfac_arm.get("kfac", {}).get(optimizer, {})}

    def arm(self, kfac: bool, optimizer: str) -> tuple[float, str, float]:
        """``(lr, schedule, warmup_epochs)`` of the K-FAC arm or of the
        first-order arm, with ``optimizer``."""
        own = self.kfac_arm if kfac else {}
        lr = own.get("lr", {}).get(optimizer, self.base_lr(optimizer))
        schedule = own.get("schedule", self.schedule)
        warmup = self.warmup_by_optimizer.get(optimizer, self.warmup_epochs)
        return float(lr), schedule, float(own.get("warmup_epochs", warmup))


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
