"""The training loop shared by ``kaisa train``, ``kaisa compare`` and the benchmark suite.

Runs advance **in lockstep**: every run of a group takes one step in turn,
each on its own clock, so whatever else the machine does while they train
falls on every run alike instead of on whichever ran last. Each run keeps its
own random-number state, so a run trained in a group is bit-identical to the
same run trained alone.

A run's clock runs only while it trains (fetching its batch, setting its lr,
its step): it is paused for every evaluation, so ``wall_time_s`` and
``time_to_target_s`` compare optimizers, not evaluation cost. On CUDA the
device is synchronised before each reading so queued kernels are charged to
the step that launched them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kaisa_lab.cli.distributed import DistContext, eval_indices, train_sampler
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.schedule import LRSchedule
from kaisa_lab.cli.snapshot import Snapshots
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.cli.trainer import Trainer, make_optimizer
from kaisa_lab.tasks.base import BatchDataset, EvalSums, Task, TaskData

__all__ = [
    "EpochRecord",
    "RunResult",
    "StepTimes",
    "eval_steps",
    "evaluate",
    "make_optimizer",
    "train_lockstep",
    "train_run",
    "warm_compiled",
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
    #: cumulative training time on the process's CPU clock (a CPU run; None
    #: on an accelerator or after a snapshot from before the CPU clock)
    cpu_time_s: float | None = None


@dataclass(frozen=True)
class StepTimes:
    """The spread of a run's step times (ms), its first steps left out.

    The quartiles say how steady the machine was while the run trained: on a
    quiet machine they sit within a few percent of the median, under a
    changing load they spread, and a ratio of two arms' times is then only as
    good as that spread."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    count: int
    #: the median step's CPU time (the process's, ms) on a CPU run: what the
    #: step costs whatever else the machine runs, where the wall clock also
    #: carries the machine's load; None on an accelerator
    cpu_median_ms: float | None = None

    #: steps of a run not counted in its spread (allocations, lazy set-up)
    skip = 5

    @classmethod
    def of(
        cls, seconds: Sequence[float], cpu_seconds: Sequence[float] | None = None
    ) -> StepTimes | None:
        kept = cls._kept(seconds)
        if not kept:
            return None
        cpu = statistics.median(cls._kept(cpu_seconds)) if cpu_seconds else None
        if len(kept) < 2:
            return cls(kept[0], kept[0], kept[0], 1, cpu)
        q1, median, q3 = statistics.quantiles(kept, n=4, method="inclusive")
        return cls(median, q1, q3, len(kept), cpu)

    @classmethod
    def _kept(cls, seconds: Sequence[float]) -> list[float]:
        return [1e3 * s for s in seconds[cls.skip :]] or [1e3 * s for s in seconds]

    @property
    def spread(self) -> float:
        """Interquartile range over the median."""
        return (self.q3_ms - self.q1_ms) / self.median_ms if self.median_ms > 0 else 0.0


@dataclass
class RunResult:
    """A finished run: its spec, per-epoch curve and when it first reached the target.

    ``initial_weights`` and ``data_order`` are fingerprints (SHA-256) of the
    weights it started from and of the order of every batch its budget would
    draw: two arms of a fair comparison have equal ones. ``stopped`` says why
    it ended: ``"target"``, ``"budget"`` (its last epoch) or ``"diverged"``.
    ``resumed_at`` lists the steps it was restored at from a snapshot
    (:mod:`kaisa_lab.cli.snapshot`): its clock then sums more than one process's.
    """

    spec: RunSpec
    metric_name: str
    higher_is_better: bool
    curve: list[EpochRecord] = field(default_factory=list)
    time_to_target_s: float | None = None
    #: the same on the CPU clock (:attr:`EpochRecord.cpu_time_s`)
    cpu_time_to_target_s: float | None = None
    steps_to_target: int | None = None
    epochs_to_target: float | None = None
    initial_weights: str = ""
    data_order: str = ""
    stopped: str = "budget"
    step_times: StepTimes | None = None
    resumed_at: list[int] = field(default_factory=list)

    @property
    def wall_time_s(self) -> float:
        return self.curve[-1].wall_time_s if self.curve else 0.0

    @property
    def final_metric(self) -> float | None:
        return self.curve[-1].metric if self.curve else None


class _Clock:
    """Accumulates training time between :meth:`start` and :meth:`stop`: the
    wall clock's, and on a CPU run the process's CPU time too (``cpu``; a
    lockstep group steps one run at a time, so the process's CPU time
    between start and stop is that run's, unaffected by other processes)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.elapsed = 0.0
        self._started = 0.0
        self.cpu: float | None = 0.0 if device.type == "cpu" else None
        self._cpu_started = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self._started = self._now()
        if self.cpu is not None:
            self._cpu_started = time.process_time()

    def stop(self) -> float:
        """Add the time since :meth:`start`; return the total."""
        if self.cpu is not None:
            self.cpu += time.process_time() - self._cpu_started
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


def warm_up(
    specs: Sequence[RunSpec], task: Task, data: TaskData, ctx: DistContext, steps: int = 3
) -> None:
    """Run a few untimed steps of each kind of run on throwaway models.

    The first steps of a process pay one-off costs (thread pools, allocator,
    lazy imports, LAPACK initialisation, a compiled optimizer's compilation);
    without a warm-up they would be charged to whichever run comes first. A
    compiled model's compilation is its own run's (:func:`warm_compiled`).
    The global random state is restored afterwards, so a warm-up changes no
    run's result.
    """
    seen: set[tuple[str, bool, int]] = set()
    state = torch.random.get_rng_state()
    try:
        for spec in specs:
            key = (spec.optimizer, spec.kfac, spec.batch_size)
            if key in seen:
                continue
            seen.add(key)
            order = torch.arange(min(len(data.train), steps * spec.batch_size))
            # eager: a compiled run compiles on its own model (warm_compiled)
            with Trainer(dataclasses.replace(spec, compile_model=None), task, ctx) as trainer:
                for chunk in order.split(spec.batch_size):
                    trainer.step(*data.train.get_batch(chunk))
    finally:
        torch.random.set_rng_state(state)


def warm_compiled(trainer: Trainer, data: TaskData, batch_size: int, steps: int = 3) -> None:
    """Compile a compiled run's graphs on its own model before its clock starts.

    A few steps on the first training batches — a factor step and a
    non-factor step among them, the two variants kaisa's capture compiles —
    then every state back as it was: the weights, the optimizer's and the
    preconditioner's state, the run's and the global generators (the same
    restore a snapshot's resume is tested to be exact with). Its hooks are
    part of its compiled code's guards (:mod:`kaisa_lab.cli.compiled`), so
    only its own model's steps compile what it will run."""
    saved = copy.deepcopy(trainer.state_dict())
    generators = _RandomState.take()
    order = torch.arange(min(len(data.train), steps * batch_size))
    try:
        for chunk in order.split(batch_size):
            trainer.step(*data.train.get_batch(chunk))
    finally:
        trainer.load_state_dict(saved)
        generators.put()


def eval_steps(steps_per_epoch: int, evals_per_epoch: int) -> frozenset[int]:
    """The steps of an epoch (1-based) after which the metric is read.

    ``evals_per_epoch`` points evenly spaced, the last at the epoch's end; more
    points than steps collapse to every step.
    """
    k = min(evals_per_epoch, steps_per_epoch)
    return frozenset(math.ceil(steps_per_epoch * i / k) for i in range(1, k + 1))


def _epoch_orders(
    data: BatchDataset, ctx: DistContext, spec: RunSpec, steps_per_epoch: int
) -> list[torch.Tensor]:
    """The sample indices of every step of every epoch of ``spec``'s budget, per epoch.

    They depend only on the seed, the epoch and the rank (never on the
    optimizer); drawn up front so their fingerprint covers the whole budget,
    whatever step a run stops at."""
    sampler = train_sampler(data, ctx, spec.seed)
    orders = []
    for epoch in range(1, spec.epochs + 1):
        sampler.set_epoch(epoch)
        taken = itertools.islice(iter(sampler), steps_per_epoch * spec.batch_size)
        orders.append(torch.tensor(list(taken), dtype=torch.int64))
    return orders


def _order_fingerprint(orders: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for order in orders:
        digest.update(order.numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class _RandomState:
    """The global generators' states (the CPU's, and CUDA's where there is one)."""

    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def take(cls) -> _RandomState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(torch.random.get_rng_state(), cuda)

    def put(self) -> None:
        torch.random.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class _Lane:
    """One run of a lockstep group: its trainer, data, schedule, clock and random state."""

    def __init__(
        self, spec: RunSpec, label: str, task: Task, data: TaskData, ctx: DistContext
    ) -> None:
        self.spec, self.label, self.task, self.data, self.ctx = spec, label, task, data, ctx
        self.trainer = Trainer(spec, task, ctx)
        length = math.ceil(len(train_sampler(data.train, ctx, spec.seed)) / spec.batch_size)
        self.steps_per_epoch = min(length, spec.steps_per_epoch or length)
        self.orders = _epoch_orders(data.train, ctx, spec, self.steps_per_epoch)
        self.schedule = LRSchedule.from_epochs(
            spec.schedule, spec.lr, spec.warmup_epochs, spec.epochs, self.steps_per_epoch
        )
        self.ends = eval_steps(self.steps_per_epoch, spec.evals_per_epoch)
        self.result = RunResult(
            spec,
            task.metric.name,
            task.metric.higher_is_better,
            initial_weights=self.trainer.initial_weights,
            data_order=_order_fingerprint(self.orders),
        )
        self.clock = _Clock(ctx.device)
        self.rng = _RandomState.take()
        self.epoch, self.epoch_step, self.step = 1, 0, 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
        self.segment_steps = 0
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self.done = False

    @property
    def total_steps(self) -> int:
        return self.spec.epochs * self.steps_per_epoch

    def advance(self) -> torch.Tensor:
        """Take one timed training step (with this run's own random state)."""
        saved = _RandomState.take()
        self.rng.put()
        before, cpu_before = self.clock.elapsed, self.clock.cpu
        self.clock.start()
        chunk = self.orders[self.epoch - 1][
            self.epoch_step * self.spec.batch_size : (self.epoch_step + 1) * self.spec.batch_size
        ]
        x, y = self.data.train.get_batch(chunk)
        if not self.schedule.is_identity:
            self.trainer.set_lr(self.schedule.lr(self.step))
        loss = self.trainer.step(x, y)
        self.clock.stop()
        self.seconds.append(self.clock.elapsed - before)
        if self.clock.cpu is not None and cpu_before is not None:
            self.cpu_seconds.append(self.clock.cpu - cpu_before)
        self.rng = _RandomState.take()
        saved.put()
        self.loss_sum += loss
        self.step += 1
        self.epoch_step += 1
        self.segment_steps += 1
        return loss

    @property
    def at_evaluation(self) -> bool:
        return self.epoch_step in self.ends  # ends holds the epoch's last step

    @property
    def at_epoch_end(self) -> bool:
        return self.epoch_step == self.steps_per_epoch

    def evaluate(self) -> tuple[EpochRecord, bool]:
        """Read the metric (off the clock); record it; return it and whether it reached."""
        totals = self.ctx.sum(
            torch.stack([self.loss_sum.cpu(), torch.tensor(float(self.segment_steps))])
        )
        train_loss = float(totals[0] / totals[1])
        self.loss_sum.zero_()
        self.segment_steps = 0
        evals = evaluate(
            self.trainer.model, self.task, self.data.test, self.ctx, self.spec.eval_batch_size
        )
        at = self.epoch - 1 + self.epoch_step / self.steps_per_epoch
        metric = evals[self.task.metric.name]
        record = EpochRecord(
            at, self.step, self.clock.elapsed, train_loss, metric, evals, self.clock.cpu
        )
        reached = self.task.metric.reached(metric, self.spec.target)
        result = self.result
        result.curve.append(record)
        if reached and result.steps_to_target is None:
            result.time_to_target_s = record.wall_time_s
            result.cpu_time_to_target_s = record.cpu_time_s
            result.steps_to_target = record.step
            result.epochs_to_target = record.epoch
        if not math.isfinite(train_loss):
            self.finish("diverged")
        elif self.spec.stop_at_target and result.steps_to_target is not None:
            self.finish("target")
        elif self.at_epoch_end and self.epoch == self.spec.epochs:
            self.finish("budget")
        return record, reached

    def next_epoch(self) -> None:
        self.epoch += 1
        self.epoch_step = 0

    def state(self) -> dict[str, Any]:
        """Everything this run's next steps and its result depend on (taken between steps)."""
        result = self.result
        return {
            "trainer": self.trainer.state_dict(),
            "rng": self.rng,
            "clock_s": self.clock.elapsed,
            "seconds": list(self.seconds),
            "cpu_clock_s": self.clock.cpu,
            "cpu_seconds": list(self.cpu_seconds),
            "position": (self.epoch, self.epoch_step, self.step, self.segment_steps),
            "loss_sum": self.loss_sum.cpu(),
            "curve": [dataclasses.asdict(r) for r in result.curve],
            "to_target": (result.time_to_target_s, result.steps_to_target, result.epochs_to_target),
            "cpu_to_target": result.cpu_time_to_target_s,
            "resumed_at": list(result.resumed_at),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state` (of a run of the same spec)."""
        self.trainer.load_state_dict(state["trainer"])
        self.rng = state["rng"]
        self.clock.elapsed = state["clock_s"]
        self.seconds = list(state["seconds"])
        # a snapshot from before the CPU clock: its steps' CPU times are unknown
        self.clock.cpu = state.get("cpu_clock_s") if self.clock.cpu is not None else None
        self.cpu_seconds = list(state.get("cpu_seconds", ()))
        self.epoch, self.epoch_step, self.step, self.segment_steps = state["position"]
        self.loss_sum = state["loss_sum"].to(self.ctx.device)
        result = self.result
        result.curve = [EpochRecord(**r) for r in state["curve"]]
        result.time_to_target_s, result.steps_to_target, result.epochs_to_target = state[
            "to_target"
        ]
        result.cpu_time_to_target_s = state.get("cpu_to_target")
        result.resumed_at = [*state["resumed_at"], self.step]

    def finish(self, why: str) -> None:
        self.done = True
        self.result.stopped = why
        # CPU times only where every step has one (not after an old snapshot)
        cpu = self.cpu_seconds if len(self.cpu_seconds) == len(self.seconds) else None
        self.result.step_times = StepTimes.of(self.seconds, cpu)
        self.trainer.close()


def _header(lane: _Lane) -> str:
    spec, schedule = lane.spec, lane.schedule
    return (
        f"[{lane.label}] {spec.task}: {spec.epochs} epochs x {lane.steps_per_epoch} steps, "
        f"batch {spec.batch_size}/rank x {lane.ctx.world_size} rank(s), lr {spec.lr:g}"
        + ("" if schedule.is_identity else f" ({spec.schedule}, warm-up {spec.warmup_epochs:g} ep)")
        + f", device {lane.ctx.device}"
    )


def train_lockstep(
    specs: Sequence[RunSpec],
    task: Task,
    data: TaskData,
    ctx: DistContext,
    progress: Progress,
    labels: Sequence[str] | None = None,
    *,
    cutoff: Callable[[int, RunResult], bool] | None = None,
    on_finish: Callable[[int, RunResult], None] | None = None,
    snapshots: Snapshots | None = None,
) -> list[RunResult]:
    """Train every spec from a fresh, seeded model, all in lockstep; results in ``specs`` order.

    Each round, every unfinished run takes one step; a run evaluates at its
    ``evals_per_epoch`` points (off its clock) and leaves the group when it
    diverges, reaches its target with ``stop_at_target``, or ends its last
    epoch. The model of a run is initialised from ``spec.seed`` and its data
    order depends only on ``spec.seed`` and the epoch, so runs that differ only
    in the optimizer start from the same weights and see the same batches.
    Every rank executes the same rounds, so under torchrun the collectives of
    the runs line up. ``labels`` name the runs in progress lines (default:
    ``spec.name``).

    ``cutoff(i, result)``, asked after each evaluation of run ``i`` that has
    not ended, may end it (``stopped = "cutoff"``: a rule of the caller's,
    e.g. a tuning run far slower than its arm's best); ``on_finish(i,
    result)`` is called as each run ends, so a long group's finished runs can
    be saved before the rest are done.

    With ``snapshots``, a run that has one goes on from it, and every
    unfinished run is snapshotted at the end of a round whenever
    ``snapshots.every_s`` has passed (off every clock); a run's snapshot is
    deleted when it ends.
    """
    labels = [spec.name for spec in specs] if labels is None else list(labels)
    if len(labels) != len(specs):
        raise ValueError(f"{len(labels)} labels for {len(specs)} runs")
    lanes: list[_Lane] = []
    with contextlib.ExitStack() as stack:
        for spec, label in zip(specs, labels):
            lane = _Lane(spec, label, task, data, ctx)
            if snapshots is not None:
                lane = _resume(lane, snapshots, progress)
            stack.callback(lane.trainer.close)
            if spec.compile_model is not None:
                warm_compiled(lane.trainer, data, spec.batch_size)
            lanes.append(lane)
            progress.log(_header(lane))
        if snapshots is not None:
            snapshots.saved()
        _run_rounds(lanes, progress, cutoff, on_finish, snapshots)
    return [lane.result for lane in lanes]


def _resume(lane: _Lane, snapshots: Snapshots, progress: Progress) -> _Lane:
    """``lane`` gone on from its snapshot, if it has one; a fresh lane where the
    snapshot cannot be read or restored (a run must not be stuck on a bad file:
    it starts again, which costs time, not correctness)."""
    try:
        saved = snapshots.load(lane.spec)
        if saved is not None:
            lane.restore(saved)
            progress.log(f"[{lane.label}] resumed from its snapshot at step {lane.step}")
        return lane
    except Exception as exc:  # any failure: the run starts afresh
        progress.log(
            f"[{lane.label}] its snapshot could not be restored ({type(exc).__name__}: "
            f"{exc}); starting it afresh"
        )
        snapshots.discard(lane.spec)
        lane.trainer.close()
        return _Lane(lane.spec, lane.label, lane.task, lane.data, lane.ctx)


def _run_rounds(
    lanes: Sequence[_Lane],
    progress: Progress,
    cutoff: Callable[[int, RunResult], bool] | None,
    on_finish: Callable[[int, RunResult], None] | None,
    snapshots: Snapshots | None = None,
) -> None:
    """Step every unfinished lane once per round until all are done."""
    name = ", ".join(lane.label for lane in lanes)
    index = {id(lane): i for i, lane in enumerate(lanes)}
    shown = 0  # the epoch the progress bar shows
    while True:
        active = [lane for lane in lanes if not lane.done]
        if not active:
            return
        if snapshots is not None and snapshots.due():
            for lane in active:
                snapshots.save(lane.spec, lane.state())
            snapshots.saved()
        lead = active[0]
        if lead.epoch != shown:
            shown = lead.epoch
            epochs = max(lane.spec.epochs for lane in active)
            progress.start_epoch(
                f"[{name}] epoch {lead.epoch}/{epochs}", lead.steps_per_epoch, lead.epoch_step
            )
        for lane in active:
            loss = lane.advance()
            if lane is lead:
                progress.step(loss)
            if not lane.at_evaluation:
                continue
            record, reached = lane.evaluate()
            if not lane.done and cutoff is not None and cutoff(index[id(lane)], lane.result):
                lane.finish("cutoff")
            if lane.at_epoch_end or lane.done:
                summary = (
                    f"[{lane.label}] epoch {lane.epoch}/{lane.spec.epochs} step {lane.step} "
                    f"train_loss {record.train_loss:.4f} {lane.task.metric.name} "
                    f"{record.metric:.4f} train_time {record.wall_time_s:.2f}s"
                    + (" (target reached)" if reached else "")
                )
                values = {"loss": record.train_loss, lane.task.metric.name: record.metric}
                if lane is lead:
                    progress.end_epoch(summary, values)
                else:
                    progress.log(summary)
            if lane.done:
                if lane.result.stopped == "diverged":
                    progress.log(f"[{lane.label}] training loss is not finite; stopping this run")
                progress.end_run()
                if on_finish is not None:
                    on_finish(index[id(lane)], lane.result)
                if snapshots is not None:
                    snapshots.discard(lane.spec)
            elif lane.at_epoch_end:
                lane.next_epoch()


def train_run(
    spec: RunSpec,
    task: Task,
    data: TaskData,
    ctx: DistContext,
    progress: Progress,
    label: str | None = None,
) -> RunResult:
    """Train ``spec`` alone (a lockstep group of one run)."""
    labels = None if label is None else [label]
    return train_lockstep([spec], task, data, ctx, progress, labels)[0]
