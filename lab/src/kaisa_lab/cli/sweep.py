"""Train every arm (e.g. SGD and SGD+K-FAC) on ``--seeds N`` seeds.

Seed ``k`` of an arm is the arm's spec with ``seed + k``; since the seed fixes
both the initial weights and the data order, the arms of one seed start from
the same weights and see the same batches, and only the optimizer differs.

The arms of one seed train in lockstep (:func:`kaisa_lab.cli.train.train_lockstep`:
each arm one step in turn, each on its own clock), so anything that changes
while they train — other load on the machine, clock throttling — falls on
every arm alike instead of on whichever arm runs last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.cli.train import RunResult, train_lockstep
from kaisa_lab.tasks.base import Task, TaskData

__all__ = ["run_seeds", "seeded"]


def seeded(spec: RunSpec, offset: int) -> RunSpec:
    """``spec`` on its ``offset``-th seed (``spec.seed + offset``)."""
    return dataclasses.replace(spec, seed=spec.seed + offset)


def run_seeds(
    specs: Sequence[RunSpec],
    n_seeds: int,
    task: Task,
    data: TaskData,
    ctx: DistContext,
    progress: Progress,
) -> list[list[RunResult]]:
    """Results grouped by arm (in ``specs`` order), each arm's in seed order.

    Every rank executes the same sequence of runs, so under torchrun the
    collectives of each run line up across ranks.
    """
    if n_seeds < 1:
        raise ValueError(f"n_seeds must be at least 1; got {n_seeds}")
    arms: list[list[RunResult]] = [[] for _ in specs]
    total = n_seeds * len(specs)
    if n_seeds > 1:
        progress.start_runs(total)
    try:
        for offset in range(n_seeds):
            group = [seeded(spec, offset) for spec in specs]
            labels = [spec.name for spec in specs]
            if n_seeds > 1:
                labels = [f"{spec.name} seed {run.seed}" for spec, run in zip(specs, group)]
                for index, label in enumerate(labels):
                    progress.log(f"run {offset * len(specs) + index + 1}/{total}: {label}")
            results = train_lockstep(group, task, data, ctx, progress, labels)
            for arm, result in zip(arms, results):
                arm.append(result)
    finally:
        progress.close_runs()
    return arms
