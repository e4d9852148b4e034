"""Run a function on W gloo ranks on this machine, so a distributed cost case runs
in one command (``kaisa bench run strategies``), without ``torchrun``.

Ranks are forked (0.1 s each; spawning costs seconds) when the parent runs
torch with one thread and has no GPU — a forked child deadlocks once the
parent has started a multi-threaded OpenMP pool, and cannot use CUDA the
parent initialised — and spawned otherwise.  Each rank runs torch with one
thread, its process group has a timeout, and the parent kills ranks that do
not finish in time, so a broken collective fails the case instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["run_ranks"]


def _rank(
    rank: int,
    world: int,
    init: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, f"{init}.result{rank}")
    except BaseException:
        with open(f"{init}.error{rank}", "w") as err:
            err.write(traceback.format_exc())
        raise


def run_ranks(
    world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 600.0
) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own
    process of one gloo group; ``fn`` and what it returns must pickle."""
    fork = torch.get_num_threads() == 1 and not torch.cuda.is_available()
    ctx: Any = mp.get_context("fork" if fork else "spawn")
    with tempfile.TemporaryDirectory(prefix="kaisa-bench-ranks-") as tmp:
        init = os.path.join(tmp, "pg")
        procs = [
            ctx.Process(target=_rank, args=(r, world, init, timeout_s / 2, fn, args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        errors = []
        deadline = time.monotonic() + timeout_s
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
                errors.append(f"rank {r}: did not finish in {timeout_s:g} s")
            elif p.exitcode != 0:
                path = Path(f"{init}.error{r}")
                why = path.read_text() if path.exists() else f"exit code {p.exitcode}"
                errors.append(f"rank {r}:\n{why}")
        if errors:
            raise RuntimeError(
                f"{getattr(fn, '__name__', fn)} on {world} ranks failed:\n" + "\n".join(errors)
            )
        return [torch.load(f"{init}.result{r}", weights_only=False) for r in range(world)]
