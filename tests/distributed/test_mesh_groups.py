"""kaisa's worker and receiver groups as two dimensions of one DeviceMesh.

``Topology.from_mesh`` takes the job's mesh; the communicator unflattens its
data-parallel dimension into ``("kfac_workers", "kfac_receivers")`` of shape
``(m, W/m)`` (the plan's rank grid: workers a column, receivers a row), so the groups compose with the other dimensions and are made by
torch's mesh machinery.  Checked on 4 gloo ranks: the groups are the plan's,
kaisa itself makes one ``new_group`` (its private copy of the data-parallel
group), group timeouts are kaisa's, training equals the single process, and
ranks asking for different meshes are refused instead of hanging.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kaisa import KFACPreconditioner, Topology

from harness import run_distributed
from test_real_loops import KW, assert_same, batches, make_model, train_plain

pytestmark = pytest.mark.distributed


def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def _timeout(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def mesh_run(rank: int, world: int, shape: tuple[int, int], fraction: float) -> dict[str, Any]:
    """Replicas × data parallel: each replica row is its own data-parallel group."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "dp"))
    calls: list[Any] = []
    real = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("ranks", args[0] if args else None))
        return real(*args, **kwargs)

    dist.new_group = counting  # what kaisa calls itself (torch's mesh keeps its own reference)
    try:
        model = make_model()
        precond = KFACPreconditioner(
            model,
            **KW,
            grad_worker_fraction=fraction,
            topology=Topology.from_mesh(mesh, dp="dp"),
            pg_timeout_s=9.0,
        )
    finally:
        dist.new_group = real
    plan, comm = precond.plan, precond.comm
    me = comm.rank
    out: dict[str, Any] = {
        "kaisa_new_group_calls": len(calls),
        "mesh_shape": tuple(comm.mesh.shape),
        "mesh_names": comm.mesh.mesh_dim_names,
        "workers": _ranks(comm.mesh.get_group("kfac_workers")),
        "receivers": _ranks(comm.mesh.get_group("kfac_receivers")),
        "plan_workers": [comm.global_ranks[r] for r in plan.worker_group_of(me)],
        "plan_receivers": [comm.global_ranks[r] for r in plan.receiver_group_of(me)],
        "timeouts": [_timeout(comm.group(range(comm.world_size)))]
        + [_timeout(comm.mesh.get_group(d)) for d in ("kfac_workers", "kfac_receivers")],
    }
    replica, w = rank // shape[1], shape[1]
    rows = 8 // w
    part = slice(rows * (rank % w), rows * (rank % w) + rows)
    data = [(x[part], y[part]) for x, y in batches(8, seed=replica)]
    return out | train_plain(model, precond, data, mesh["dp"].get_group(), w)


@pytest.mark.parametrize(
    ("shape", "fraction"),
    [((1, 4), 0.5), ((2, 2), 1.0), ((2, 2), 0.5)],
    ids=["dp4-hybrid", "rep2xdp2-comm-opt", "rep2xdp2-mem-opt"],
)
def test_groups_are_mesh_dimensions_and_training_equals_one_process(
    shape: tuple[int, int], fraction: float
) -> None:
    results = run_distributed(4, mesh_run, shape, fraction, timeout_s=90, pg_timeout_s=20)
    w = shape[1]
    m = round(fraction * w)
    for rank, got in enumerate(results):
        assert got["kaisa_new_group_calls"] == 1, got["kaisa_new_group_calls"]
        assert got["mesh_names"] == ("kfac_workers", "kfac_receivers")
        assert got["mesh_shape"] == (m, w // m)
        assert got["workers"] == got["plan_workers"], rank
        assert got["receivers"] == got["plan_receivers"], rank
        assert rank in got["workers"] and rank in got["receivers"]
        assert got["timeouts"] == [9.0, 9.0, 9.0]
    for replica in range(shape[0]):
        model = make_model()
        ref = train_plain(
            model,
            KFACPreconditioner(model, **KW, grad_worker_fraction=fraction),
            batches(8, seed=replica),
        )
        for rank in range(replica * w, replica * w + w):
            assert_same(results[rank], ref, f"mesh {shape} f={fraction} rank {rank}")


def mismatched(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    try:
        KFACPreconditioner(
            make_model(),
            grad_worker_fraction=1.0 if rank < 2 else 0.5,
            topology=Topology.from_mesh(mesh, dp="dp"),
        )
    except ValueError as exc:
        return str(exc)
    return ""


def test_different_worker_counts_on_one_mesh_are_refused() -> None:
    for message in run_distributed(4, mismatched, timeout_s=60, pg_timeout_s=20):
        assert "same number of gradient workers" in message


def world_hybrid(rank: int, world: int) -> dict[str, Any]:
    """Without a mesh, on the whole world, the groups still come from one."""
    precond = KFACPreconditioner(make_model(), grad_worker_fraction=0.5)
    comm = precond.comm
    return {
        "shape": tuple(comm.mesh.shape),
        "workers": _ranks(comm.mesh.get_group("kfac_workers")),
        "receivers": _ranks(comm.mesh.get_group("kfac_receivers")),
    }


def test_world_without_mesh_gets_a_kaisa_mesh() -> None:
    results = run_distributed(4, world_hybrid, timeout_s=60, pg_timeout_s=20)
    for rank, got in enumerate(results):
        assert got["shape"] == (2, 2)
        assert got["workers"] == [rank % 2, rank % 2 + 2]  # a column of the 2 × 2 grid
        assert got["receivers"] == [rank - rank % 2, rank - rank % 2 + 1]  # a row
