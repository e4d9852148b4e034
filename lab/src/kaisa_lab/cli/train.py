"""The training loop shared by ``kaisa train`` and ``kaisa compare``.

The clock runs only while training: it is paused for every
evaluation, so ``wall_time_s`` and ``time_to_target_s`` compare optimizers, not
evaluation cost. On CUDA the device is synchronised before each reading so
queued kernels are charged to the phase that launched them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kaisa_lab.cli.distributed import DistContext, eval_indices, train_sampler
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.schedule import LRSchedule
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.optim import build_optimizer
from kaisa_lab.tasks.base import BatchDataset, EvalSums, Task, TaskData

__all__ = [
    "EpochRecord",
    "RunResult",
    "eval_steps",
    "evaluate",
    "make_optimizer",
    "train_run",
    "warm_up",
]


@dataclass(frozen=True)
class EpochRecord:
    """State at one evaluation; ``wall_time_s`` is cumulative training time.

    ``epoch`` counts epochs done, fractional when evaluating more than once an
    epoch (``--evals-per-epoch``).
    """

    epoch: float
    step: int
    wall_time_s: float
    train_loss: float
    metric: float
    eval: dict[str, float] = field(default_factory=dict)


@dataclass
class RunResult:
    """A finished run: its spec, per-epoch curve and when it first reached the target."""

    spec: RunSpec
    metric_name: str
    higher_is_better: bool
    curve: list[EpochRecord] = field(default_factory=list)
    time_to_target_s: float | None = None
    steps_to_target: int | None = None
    epochs_to_target: float | None = None

    @property
    def wall_time_s(self) -> float:
        return self.curve[-1].wall_time_s if self.curve else 0.0

    @property
    def final_metric(self) -> float | None:
        return self.curve[-1].metric if self.curve else None


def make_optimizer(spec: RunSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``spec`` over ``model`` (:func:`kaisa_lab.optim.build_optimizer`)."""
    return build_optimizer(
        spec.optimizer,
        model,
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        momentum=spec.momentum,
        adamw_lr=spec.adamw_lr,
        adamw_weight_decay=spec.adamw_weight_decay,
    )


class _Clock:
    """Accumulates training time between :meth:`start` and :meth:`stop`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.elapsed = 0.0
        self._started = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._started = self._now()

    def stop(self) -> float:
        self.elapsed += self._now() - self._started
        return self.elapsed


@torch.no_grad()
def evaluate(
    model: nn.Module, task: Task, dataset: BatchDataset, ctx: DistContext, batch_size: int
) -> dict[str, float]:
    """The task's metrics on ``dataset``; each rank scores a shard and the sums are reduced."""
    was_training = model.training
    ctx.sync_buffers(model)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for chunk in eval_indices(len(dataset), ctx).split(batch_size):
        x, y = dataset.get_batch(chunk)
        x, y = x.to(ctx.device), y.to(ctx.device)
        sums += task.eval_sums(model(x), y).as_tensor()
    model.train(was_training)
    return task.summarize(EvalSums.from_tensor(ctx.sum(sums)))


def _batches(
    dataset: BatchDataset, indices: Iterable[int], batch_size: int, limit: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """At most ``limit`` batches, in the order of ``indices`` (read only as far as needed)."""
    order = torch.tensor(list(itertools.islice(indices, limit * batch_size)), dtype=torch.int64)
    for chunk in order.split(batch_size):
        yield dataset.get_batch(chunk)


class _Trainer:
    """Model, optimizer and (optional) preconditioner of one run, and its training step.

    Shared by :func:`train_run` and :func:`warm_up` so both execute exactly the
    same code. Use as a context manager: K-FAC's hooks are removed on exit.
    """

    def __init__(self, spec: RunSpec, task: Task, ctx: DistContext) -> None:
        self.task = task
        self.device = ctx.device
        torch.manual_seed(spec.seed)
        self.model = task.build_model().to(ctx.device)
        self.net = ctx.wrap(self.model)
        self.optimizer = make_optimizer(spec, self.model)
        # The schedule scales every group's own lr (muon's AdamW part has another).
        self._lr_scales = [group["lr"] / spec.lr for group in self.optimizer.param_groups]
        self.preconditioner: Any = None
        if spec.kfac:
            # Imported here so that first-order runs work even while the
            # preconditioner module is missing or broken.
            from kaisa.preconditioner import KFACPreconditioner

            # Hooks go on the unwrapped model so layer names (and the
            # --kfac-skip-layers patterns matched against them) do not depend on DDP.
            self.preconditioner = KFACPreconditioner(
                self.model, optimizer=self.optimizer, pg_timeout_s=ctx.timeout_s, **spec.kfac_kwargs
            )

    def __enter__(self) -> _Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.preconditioner is not None:
            self.preconditioner.remove_hooks()

    def set_lr(self, lr: float) -> None:
        """Set the lr of the run's schedule: each parameter group's lr is ``lr`` times its
        own initial lr over the run's (1 for every group but muon's AdamW part, so
        exactly ``lr`` there); K-FAC reads it from the optimizer at its step."""
        for group, scale in zip(self.optimizer.param_groups, self._lr_scales):
            group["lr"] = lr * scale

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a batch; returns the (detached) batch loss."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss(self.net(x), y)
        loss.backward()
        if self.preconditioner is not None:
            self.preconditioner.step()
        self.optimizer.step()
        return loss.detach()


def warm_up(
    specs: list[RunSpec], task: Task, data: TaskData, ctx: DistContext, steps: int = 3
) -> None:
    """Run a few untimed steps of each kind of run on throwaway models.

    The first steps of a process pay one-off costs (thread pools, allocator,
    lazy imports, LAPACK initialisation); without a warm-up ``compare`` would
    charge them to whichever run comes first.
    """
    seen: set[tuple[str, bool]] = set()
    for spec in specs:
        if (spec.optimizer, spec.kfac) in seen:
            continue
        seen.add((spec.optimizer, spec.kfac))
        order = list(range(min(len(data.train), steps * spec.batch_size)))
        with _Trainer(spec, task, ctx) as trainer:
            for x, y in _batches(data.train, order, spec.batch_size, steps):
                trainer.step(x, y)


def eval_steps(steps_per_epoch: int, evals_per_epoch: int) -> frozenset[int]:
    """The steps of an epoch (1-based) after which the metric is read.

    ``evals_per_epoch`` points evenly spaced, the last at the epoch's end; more
    points than steps collapse to every step.
    """
    k = min(evals_per_epoch, steps_per_epoch)
    return frozenset(math.ceil(steps_per_epoch * i / k) for i in range(1, k + 1))


def _mean_loss(ctx: DistContext, loss_sum: torch.Tensor, steps: int) -> float:
    """Mean training loss over ``steps`` steps of every rank (a collective)."""
    totals = ctx.sum(torch.stack([loss_sum.cpu(), torch.tensor(float(steps))]))
    return float(totals[0] / totals[1])


def _record(result: RunResult, record: EpochRecord, reached: bool) -> None:
    """Append ``record``; the first that reaches the target sets the to-target fields."""
    result.curve.append(record)
    if reached and result.steps_to_target is None:
        result.time_to_target_s = record.wall_time_s
        result.steps_to_target = record.step
        result.epochs_to_target = record.epoch


def _stop(spec: RunSpec, result: RunResult, train_loss: float) -> bool:
    """Whether the run ends early: the loss diverged, or the target is reached and wanted."""
    return not math.isfinite(train_loss) or (
        spec.stop_at_target and result.steps_to_target is not None
    )


def train_run(
    spec: RunSpec,
    task: Task,
    data: TaskData,
    ctx: DistContext,
    progress: Progress,
    label: str | None = None,
) -> RunResult:
    """Train ``spec`` from a fresh, seeded model; evaluate ``spec.evals_per_epoch`` times an epoch.

    The model is initialised from ``spec.seed`` and the data order depends only
    on ``spec.seed`` and the epoch, so two specs that differ only in the
    optimizer see the same initial weights and the same batches. ``label``
    names the run in progress lines (default: ``spec.name``).
    """
    label = spec.name if label is None else label
    sampler = train_sampler(data.train, ctx, spec.seed)
    steps_per_epoch = math.ceil(len(sampler) / spec.batch_size)
    if spec.steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, spec.steps_per_epoch)
    schedule = LRSchedule.from_epochs(
        spec.schedule, spec.lr, spec.warmup_epochs, spec.epochs, steps_per_epoch
    )
    result = RunResult(spec, task.metric.name, task.metric.higher_is_better)
    clock = _Clock(ctx.device)
    step = 0
    progress.log(
        f"[{label}] {spec.task}: {spec.epochs} epochs x {steps_per_epoch} steps, "
        f"batch {spec.batch_size}/rank x {ctx.world_size} rank(s), lr {spec.lr:g}"
        + ("" if schedule.is_identity else f" ({spec.schedule}, warm-up {spec.warmup_epochs:g} ep)")
        + f", device {ctx.device}"
    )
    with _Trainer(spec, task, ctx) as trainer:
        for epoch in range(1, spec.epochs + 1):
            sampler.set_epoch(epoch)
            trainer.model.train()
            progress.start_epoch(f"[{label}] epoch {epoch}/{spec.epochs}", steps_per_epoch)
            ends = eval_steps(steps_per_epoch, spec.evals_per_epoch)
            loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
            segment_steps = 0
            clock.start()
            for epoch_step, (x, y) in enumerate(
                _batches(data.train, sampler, spec.batch_size, steps_per_epoch), start=1
            ):
                if not schedule.is_identity:
                    trainer.set_lr(schedule.lr(step))
                loss = trainer.step(x, y)
                loss_sum += loss
                step += 1
                segment_steps += 1
                progress.step(loss)
                if epoch_step not in ends:  # ends holds the epoch's last step
                    continue
                elapsed = clock.stop()
                # --- clock paused: reductions and evaluation are not training time ---
                train_loss = _mean_loss(ctx, loss_sum, segment_steps)
                loss_sum.zero_()
                segment_steps = 0
                evals = evaluate(trainer.model, task, data.test, ctx, spec.eval_batch_size)
                at = epoch - 1 + epoch_step / steps_per_epoch
                record = EpochRecord(at, step, elapsed, train_loss, evals[task.metric.name], evals)
                reached = task.metric.reached(record.metric, spec.target)
                _record(result, record, reached)
                if epoch_step != steps_per_epoch and not _stop(spec, result, train_loss):
                    clock.start()
                    continue
                progress.end_epoch(
                    f"[{label}] epoch {epoch}/{spec.epochs} step {step} "
                    f"train_loss {train_loss:.4f} {task.metric.name} {record.metric:.4f} "
                    f"train_time {elapsed:.2f}s" + (" (target reached)" if reached else ""),
                    {"loss": train_loss, task.metric.name: record.metric},
                )
                break
            if result.curve and not math.isfinite(result.curve[-1].train_loss):
                progress.log(f"[{label}] training loss is not finite; stopping this run")
                break
            if spec.stop_at_target and result.steps_to_target is not None:
                break
    return result
