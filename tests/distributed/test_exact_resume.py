"""A resume from the default checkpoint is exact: bit for bit, mid-interval, at every fraction.

``precond.state_dict()`` holds what an exact resume needs (the eigenbases or
inverses included), as torch.optim's does. Each case: an uninterrupted run,
and the same run stopped between two inverse updates, saved with the
defaults of ``state_dict()`` (kaisa, model, optimizer), rebuilt and resumed —
on one rank and on two, at every fraction two ranks allow; the same through
``torch.distributed.checkpoint`` with ``sharded_state_dict()``. A factors-only
checkpoint (``include_second_order=False``, either kind) recomputes the
inverses from later factors, so its resume differs: shown, so that the
default is seen to matter.  A sharded checkpoint loaded at another world
size, fraction or factor layout equals the gathered one loaded there.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from harness import run_distributed
from test_comm_memory_checkpoint import TOTAL_STEPS, make_run, steps

pytestmark = pytest.mark.distributed

CUT = 3  # inverses at steps 0, 2, 4 (inv_update_steps=2): step 3 resumes mid-interval


def _resumed(
    rank: int,
    world: int,
    fraction: float,
    second_order: bool | None,
    path: str | None = None,
) -> list[Any]:
    """Train to CUT, checkpoint (gathered, or sharded through DCP at ``path``),
    rebuild, resume, train to the end; the parameters."""
    import torch.distributed.checkpoint as dcp

    model, opt, precond = make_run(fraction)
    steps(model, opt, precond, rank, world, 0, CUT, [])
    kw = {} if second_order is None else {"include_second_order": second_order}
    kfac = precond.sharded_state_dict(**kw) if path else precond.state_dict(**kw)
    ckpt = copy.deepcopy({"kfac": kfac, "model": model.state_dict(), "opt": opt.state_dict()})
    if path:
        dcp.save({"kfac": kfac}, checkpoint_id=path)
    model, opt, precond = make_run(fraction)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    if path:
        template = {"kfac": precond.sharded_state_dict(**kw)}
        dcp.load(template, checkpoint_id=path)
        precond.load_sharded_state_dict(template["kfac"])
    else:
        precond.load_state_dict(ckpt["kfac"])
    steps(model, opt, precond, rank, world, CUT, TOTAL_STEPS, [])
    return [p.detach().clone() for p in model.parameters()]


def _case(rank: int, world: int, fraction: float, path: str) -> dict[str, Any]:
    model, opt, precond = make_run(fraction)
    steps(model, opt, precond, rank, world, 0, TOTAL_STEPS, [])
    ref = [p.detach().clone() for p in model.parameters()]

    def same(got: list[Any]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))

    return {
        "default": same(_resumed(rank, world, fraction, None)),
        "factors_only": same(_resumed(rank, world, fraction, False)),
        "sharded": same(_resumed(rank, world, fraction, None, f"{path}/sharded")),
        "sharded_factors_only": same(_resumed(rank, world, fraction, False, f"{path}/factors")),
        "params": ref,
    }


@pytest.mark.parametrize(("world", "fraction"), [(1, 1.0), (2, 1.0), (2, 0.5)])
def test_the_default_checkpoint_resumes_bit_for_bit(world: int, fraction: float, tmp_path) -> None:
    path = str(tmp_path)
    results = (
        [_case(0, 1, fraction, path)]
        if world == 1
        else run_distributed(world, _case, fraction, path)
    )
    for rank, got in enumerate(results):
        assert got["default"], f"W={world} f={fraction} rank {rank}: not bit for bit"
        assert got["sharded"], f"W={world} f={fraction} rank {rank}: sharded, not bit for bit"
        assert not got["factors_only"], f"W={world} f={fraction} rank {rank}"
        assert not got["sharded_factors_only"], f"W={world} f={fraction} rank {rank}"
        # the replicas themselves agree bit for bit (a worker's own second-order
        # tensors and those a broadcast delivered are laid out alike)
        for a, b in zip(got["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b), f"W={world} f={fraction}: rank {rank} drifted from rank 0"
