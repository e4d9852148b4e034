"""The work plan is a pure function: tested without any process group."""

from __future__ import annotations

import random

import pytest

from kaisa.config import AssignmentStrategy, DistributedStrategy
from kaisa.distributed.plan import LayerSpec, allowed_fractions, grad_workers_for, make_plan


def resnet_like(n: int = 12, seed: int = 0) -> list[LayerSpec]:
    rng = random.Random(seed)
    return [
        LayerSpec.kfac(
            f"layer{i}", rng.choice([28, 64, 147, 577, 1153]), rng.choice([10, 64, 128, 256])
        )
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("fraction", "world", "expected"),
    [
        (DistributedStrategy.COMM_OPT, 8, 8),
        (DistributedStrategy.HYBRID_OPT, 8, 4),
        (DistributedStrategy.MEM_OPT, 8, 1),
        (0.0, 8, 1),
        (0.25, 8, 2),
        (1.0, 1, 1),
        (DistributedStrategy.HYBRID_OPT, 1, 1),
        (0.5, 2, 1),
        (1 / 3, 6, 2),
    ],
)
def test_grad_workers_for(fraction, world, expected) -> None:
    assert grad_workers_for(fraction, world) == expected


@pytest.mark.parametrize(
    ("fraction", "world"), [(0.3, 4), (0.75, 4), (DistributedStrategy.HYBRID_OPT, 3), (0.4, 8)]
)
def test_fraction_that_gives_unequal_groups_is_refused(fraction, world) -> None:
    with pytest.raises(ValueError, match=f"world size {world}.*Allowed fractions") as info:
        grad_workers_for(fraction, world)
    for allowed in allowed_fractions(world):
        assert f"{allowed:g}" in str(info.value)


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_fraction_out_of_range(fraction) -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        grad_workers_for(fraction, 4)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("colocate", [True, False])
def test_plan_invariants(world, fraction, colocate) -> None:
    if world == 1 and fraction == 0.5:
        fraction = 1.0
    layers = resnet_like()
    plan = make_plan(layers, world, fraction, "compute", colocate)
    m = plan.grad_workers
    assert sorted(r for g in plan.worker_groups for r in g) == list(range(world))
    assert all(len(g) == m for g in plan.worker_groups)
    assert all(len(g) == world // m for g in plan.receiver_groups)
    assert [lp.name for lp in plan.layers] == [s.name for s in layers]
    for lp in plan.layers:
        # each factor has exactly one decomposer, inside the layer's worker group
        assert lp.grad_workers in plan.worker_groups
        assert lp.owner_of("A") in lp.grad_workers and lp.owner_of("G") in lp.grad_workers
        if colocate:
            assert lp.colocated
        # every rank receives the layer's preconditioned gradient from exactly one worker
        receivers = sorted(r for g in lp.receiver_groups for r in g)
        assert receivers == list(range(world))
        n = world // m
        for rank in range(world):
            # KAISA's m × n grid: the worker serving a rank is in its row of n consecutive ranks
            assert lp.gradient_source(rank) in lp.grad_workers
            assert lp.gradient_source(rank) // n == rank // n
            assert lp.is_grad_worker(rank) == (rank in lp.grad_workers)
        assert lp.grad_workers == tuple(range(lp.grad_workers[0], world, n))
    for rank in range(world):
        assert plan.receiver_group_of(rank) == tuple(range(rank - rank % n, rank - rank % n + n))
        assert rank in plan.worker_group_of(rank)


def test_comm_opt_and_mem_opt_extremes() -> None:
    layers = resnet_like()
    comm = make_plan(layers, 4, DistributedStrategy.COMM_OPT)
    mem = make_plan(layers, 4, DistributedStrategy.MEM_OPT)
    for lp in comm.layers:
        assert lp.grad_workers == (0, 1, 2, 3)
        assert all(len(g) == 1 for g in lp.receiver_groups)  # nothing to broadcast per step
    for lp in mem.layers:
        assert lp.grad_workers == (lp.owner_of("A"),)
        assert lp.receiver_groups == (
            (lp.owner_of("A"), *[r for r in range(4) if r != lp.owner_of("A")]),
        )


@pytest.mark.parametrize("strategy", ["compute", "memory"])
@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_greedy_balance_bound(strategy, fraction) -> None:
    # Longest-processing-time: the most loaded rank exceeds the least loaded
    # by at most the largest single item.
    layers = resnet_like(40, seed=3)
    plan = make_plan(layers, 8, fraction, strategy, colocate_factors=True)
    power = 3 if strategy == "compute" else 2
    loads = [plan.rank_load(r)["decomposition_cost"] for r in range(8)]
    sizes = [sum(f.dim**power for f in s.factors) for s in layers]
    assert max(loads) - min(loads) <= max(sizes)
    assert sum(loads) == pytest.approx(sum(sizes))


def test_assignment_strategy_changes_costs() -> None:
    layers = [LayerSpec.kfac("big", 1000, 10)] + [LayerSpec.kfac(n, 600, 10) for n in "abcd"]
    compute = make_plan(layers, 2, 0.0, AssignmentStrategy.COMPUTE)
    memory = make_plan(layers, 2, 0.0, AssignmentStrategy.MEMORY)
    # n³: 1000³ > 4·600³, so "big" sits alone; n²: 1000² < 4·600², so it gets company
    assert [lp.owner_of("A") for lp in compute.layers].count(
        compute.layer("big").owner_of("A")
    ) == 1
    assert [lp.owner_of("A") for lp in memory.layers].count(memory.layer("big").owner_of("A")) == 2


def test_split_factors_balance_better_than_colocated() -> None:
    layers = [LayerSpec.kfac("only", 512, 512)]
    split = make_plan(layers, 2, 1.0, colocate_factors=False)
    assert split.layers[0].owner_of("A") != split.layers[0].owner_of("G")
    assert make_plan(layers, 2, 1.0, colocate_factors=True).layers[0].colocated


def test_plan_is_deterministic_and_describable() -> None:
    layers = resnet_like()
    a = make_plan(layers, 8, 0.5)
    assert a == make_plan(layers, 8, 0.5)
    text = a.describe()
    assert "world_size=8, grad_workers=4" in text
    assert "receiver groups: [[0, 1], [2, 3], [4, 5], [6, 7]]" in text
    assert "worker groups:   [[0, 2, 4, 6], [1, 3, 5, 7]]" in text
    assert all(f"layer{i}" in text for i in range(12))
    assert (
        len([line for line in text.splitlines() if line.strip().startswith(tuple("01234567"))]) == 8
    )


@pytest.mark.parametrize(
    ("world", "fraction", "workers", "receivers"),
    [
        # MEM-OPT past max_rows: 128 one-rank columns, one row of 128
        (128, 1 / 128, "128 groups of 1 (e.g. 0)", "1 group of 128 (e.g. 0, 1, …, 127)"),
        (128, 1.0, "1 group of 128 (e.g. 0, 1, …, 127)", "128 groups of 1 (e.g. 0)"),
        # columns of two and three ranks are shown whole, not as a span
        (192, 2 / 192, "96 groups of 2 (e.g. 0, 96)", "2 groups of 96 (e.g. 0, 1, …, 95)"),
        (195, 3 / 195, "65 groups of 3 (e.g. 0, 65, 130)", "3 groups of 65 (e.g. 0, 1, …, 64)"),
        (260, 4 / 260, "65 groups of 4 (e.g. 0, 65, …, 195)", "4 groups of 65 (e.g. 0, 1, …, 64)"),
    ],
)
def test_describe_summarises_groups_as_they_are(
    world: int, fraction: float, workers: str, receivers: str
) -> None:
    """A summarised group names its own ranks: a one-rank group was shown as
    ``(e.g. 0, 1, …, 0)`` (issue 21)."""
    lines = make_plan([LayerSpec.kfac("a", 4, 4)], world, fraction).describe().splitlines()
    assert lines[1] == f"  worker groups:   {workers}"
    assert lines[2] == f"  receiver groups: {receivers}"


def test_memory_per_rank_shrinks_with_fraction() -> None:
    layers = [LayerSpec.kfac(f"l{i}", 256, 256) for i in range(8)]
    elems = {}
    for f in (1.0, 0.5, 0.0):
        plan = make_plan(layers, 8, f)
        elems[f] = max(plan.rank_load(r)["second_order_elements"] for r in range(8))
    assert elems[1.0] == 8 * elems[0.0]
    assert elems[0.5] == 4 * elems[0.0]


def test_duplicate_names_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        make_plan([LayerSpec.kfac("x", 2, 2), LayerSpec.kfac("x", 3, 3)], 2)


def test_plan_at_4096_ranks_is_compact_and_constant_time() -> None:
    """At L=1000, W=4096 layers share their worker tuple, receiver groups are
    derived, lookups are arithmetic and describe() summarises (timings:
    ``kaisa bench run plan-scale``)."""
    specs = [LayerSpec.kfac(f"l{i}", 64 + i % 50, 32 + i % 20) for i in range(1000)]
    for fraction in (1.0, 0.5, 1 / 4096):
        plan = make_plan(specs, 4096, fraction)
        m = plan.grad_workers
        n = 4096 // m
        assert len({id(lp.grad_workers) for lp in plan.layers}) <= n
        for rank in (0, 1, 4095):
            for lp in plan.layers[:50]:
                src = lp.gradient_source(rank)
                assert lp.is_grad_worker(src) and src // n == rank // n
                assert lp.is_grad_worker(rank) == (rank in lp.grad_workers)
                assert lp.receiver_group_of(rank)[0] == src
                assert set(lp.receiver_group_of(rank)) == set(plan.receiver_group_of(rank))
        text = plan.describe()
        assert len(text.splitlines()) < 100 and "median" in text and "largest of 1000" in text
