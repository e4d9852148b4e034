"""Train every arm (e.g. SGD and SGD+K-FAC) on ``--seeds N`` seeds.

Seed ``k`` of an arm is the arm's spec with ``seed + k``; since the seed fixes
both the initial weights and the data order, the arms of one seed start from
the same weights and see the same batches, and only the optimizer differs.

Runs are interleaved by seed (seed 0 of every arm, then seed 1, ...) rather
than grouped by arm, so anything that drifts during a long comparison (other
load on the machine, clock throttling) is spread over the arms instead of
being charged to whichever arm runs last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.cli.train import RunResult, train_run
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
            for index, (arm, spec) in enumerate(zip(arms, specs)):
                run_spec = seeded(spec, offset)
                label = spec.name
                if n_seeds > 1:
                    label = f"{spec.name} seed {run_spec.seed}"
                    number = offset * len(specs) + index + 1
                    progress.log(f"run {number}/{total}: {label}")
                arm.append(train_run(run_spec, task, data, ctx, progress, label=label))
                progress.end_run()
    finally:
        progress.close_runs()
    return arms
