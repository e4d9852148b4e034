"""Run a function on W forked gloo ranks and collect what each returns.

Fork costs ~0.1 s per rank (spawn: seconds), and is safe because the test
process runs torch with one thread (tests/conftest.py).  Where CUDA exists
(the lent GPU machine) the parent may already hold CUDA and autograd's
device threads, which a forked child cannot use; there the ranks fork from a
forkserver that imported torch and nothing else.  Every process group
has a timeout, and the parent kills the children if they do not report in
time, so a broken collective fails the test instead of hanging the suite.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    queue: Any,
    pg_timeout_s: float,
) -> None:
    try:
        torch.set_num_threads(1)
        # Outside fork, tensors in ``args`` arrive in memory shared by all ranks;
        # a rank updating one in place (an optimizer's loaded momentum) would
        # change it for the others.  Each rank gets its own copy, as under fork.
        args = copy.deepcopy(args)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Results travel through a file: torch's queue pickler would share
        # tensor storage via file descriptors that die with this process.
        torch.save(result, f"{init_file}.result{rank}")
        queue.put((rank, "ok", None))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))


def _context() -> Any:
    # KAISA_TEST_FORKSERVER=1 gives every rank its own hash seed, as torchrun does
    if not torch.cuda.is_available() and not os.environ.get("KAISA_TEST_FORKSERVER"):
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    return ctx


def cpu_mesh(world_size: int) -> Any:
    """A CPU mesh over all ranks: ``fully_shard``'s default mesh is cuda where
    a GPU exists, and these tests shard over gloo on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,))


def run_distributed(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, run in parallel."""
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, fn, args, queue, pg_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout_s)
                if status == "ok":
                    results[rank] = torch.load(f"{init_file}.result{rank}", weights_only=False)
                else:
                    errors.append(f"rank {rank}:\n{payload}")
        except Exception as exc:  # queue.Empty: somebody hung
            errors.append(f"timed out after {timeout_s}s waiting for ranks: {exc!r}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
