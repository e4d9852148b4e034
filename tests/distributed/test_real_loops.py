"""Training loops as users write them, on 2 and 4 gloo ranks.

Each distributed run is compared with a single process on the same rows
(float64, relative error ≤ 1e-10): unequal local batches, an extra forward
on one rank, a branch taken on one rank only, a gradient present on some
ranks only, several data-parallel groups side by side, and the KL clip
summed over pipeline stages.  None of them may hang (the harness times out).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa import KFACPreconditioner, Topology
from kfac_defaults import kfac_pytorch

from harness import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-10
# written for kfac-pytorch's values: factors every step, the eigen method (a config may
# name its own)
KW: dict[str, Any] = kfac_pytorch(damping=0.01, kl_clip=0.05, inv_update_steps=2)
CONFIGS = [
    dict(grad_worker_fraction=1.0),
    dict(grad_worker_fraction=0.0, compute_method="inverse"),
    dict(grad_worker_fraction=0.0, colocate_factors=False, symmetry_aware=True),
]


class Branchy(nn.Module):
    """A trunk, a branch that may be skipped, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(5, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def make_model() -> Branchy:
    torch.manual_seed(0)
    return Branchy().double()


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for _ in range(3)
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def record(model: nn.Module, precond: KFACPreconditioner, out: dict[str, Any]) -> None:
    out.setdefault("grads", []).append(
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    )


def finish(model: nn.Module, precond: KFACPreconditioner, out: dict[str, Any]) -> dict[str, Any]:
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["factors"] = precond.state_dict()["layers"]
    return out


def assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
        assert set(g) == set(r), f"{what}: step {step} gradients present differ"
        for n in r:
            assert rel(g[n], r[n]) <= TOL, f"{what}: step {step} grad {n} {rel(g[n], r[n]):.2e}"
    for n, p in ref["params"].items():
        assert rel(got["params"][n], p) <= TOL, f"{what}: param {n}"
    for name, entry in ref["factors"].items():
        for key, value in entry.items():
            err = rel(got["factors"][name][key], value)
            assert err <= TOL, f"{what}: factor {name}.{key} {err:.2e}"


# -- unequal batches and an extra forward on one rank ---------------------------------------------

SPLIT = [(0, 3), (3, 8)]  # rank 0 holds 3 rows, rank 1 holds 5
EMPTY = [(0, 0), (0, 8)]  # rank 0 holds none (the last batch of an epoch, unpadded)


def single(config: dict[str, Any], rows: int = 8) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **(KW | config))
    out: dict[str, Any] = {}
    for x, y in batches(rows):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        record(model, precond, out)
        opt.step()
    return finish(model, precond, out)


def unequal(
    rank: int, world: int, config: dict[str, Any], extra: bool, split: list[tuple[int, int]]
) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **(KW | config))
    lo, hi = split[rank]
    out: dict[str, Any] = {"warnings": []}
    for x, y in batches(8):
        x, y = x[lo:hi], y[lo:hi]
        opt.zero_grad()
        if extra and rank == 0:
            model(x[:2])  # e.g. a metric in training mode, never backpropagated
        # the local mean (a sum over no rows is 0, where a mean would be NaN)
        (F.cross_entropy(model(x), y, reduction="sum") / max(hi - lo, 1)).backward()
        for p in model.parameters():  # the gradient of the mean over all 8 rows
            p.grad *= hi - lo
            dist.all_reduce(p.grad)
            p.grad /= 8
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        out["warnings"] += [str(w.message) for w in caught]
        record(model, precond, out)
        opt.step()
    out["agree_calls"] = precond.comm_stats()["total"]["agree"]["calls"]
    return finish(model, precond, out)


@pytest.mark.parametrize(
    ("extra", "split"),
    [(False, SPLIT), (True, SPLIT), (False, EMPTY)],
    ids=["plain", "extra-forward-on-rank-0", "no-rows-on-rank-0"],
)
def test_unequal_local_batches_equal_single_process_on_all_rows(
    extra: bool, split: list[tuple[int, int]]
) -> None:
    for config in CONFIGS:
        results = run_distributed(2, unequal, config, extra, split, timeout_s=60, pg_timeout_s=20)
        ref = single(config)
        for rank, got in enumerate(results):
            assert_same(got, ref, f"rank {rank} {config}")
            assert got["agree_calls"] == 3  # hand-averaged gradients: ranks agree each step
        if extra:
            assert any("paused()" in w for w in results[0]["warnings"])
            assert not any("paused()" in w for w in results[1]["warnings"])


# -- a branch taken on one rank only --------------------------------------------------------------


def branch_on_rank_0(rank: int, world: int, config: dict[str, Any], ddp: bool) -> dict[str, Any]:
    model = make_model()
    net: nn.Module = DistributedDataParallel(model, find_unused_parameters=True) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(net, **(KW | config))
    out: dict[str, Any] = {}
    for x, y in batches(8):
        x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
        opt.zero_grad()
        F.cross_entropy(net(x, use_branch=rank == 0), y).backward()
        if not ddp:
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        record(model, precond, out)
        opt.step()
    return finish(model, precond, out)


def branch_reference(config: dict[str, Any]) -> dict[str, Any]:
    """The single process: each half of the batch through its own path, the loss
    their mean — exactly what the two ranks compute together."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **(KW | config))
    out: dict[str, Any] = {}
    for x, y in batches(8):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[:4]), y[:4]) + F.cross_entropy(
            model(x[4:], use_branch=False), y[4:]
        )
        (loss / 2).backward()
        precond.step()
        record(model, precond, out)
        opt.step()
    return finish(model, precond, out)


@pytest.mark.parametrize("ddp", [False, True], ids=["manual", "ddp-find-unused"])
def test_branch_taken_on_one_rank_only(ddp: bool) -> None:
    # In the reference one optimizer step holds two forward calls (each half
    # batch: the loss term of each is a mean over 4 rows, halved), which is
    # exactly accumulation over two micro-batches; the factors of the branch
    # are then the statistics of rank 0's rows alone.
    for config in CONFIGS[:2]:
        results = run_distributed(2, branch_on_rank_0, config, ddp, timeout_s=60, pg_timeout_s=20)
        ref = branch_reference({**config, "accumulation_steps": 2})
        for rank, got in enumerate(results):
            assert_same(got, ref, f"rank {rank} {config}")


# -- a gradient present on some ranks only -------------------------------------------------------


def grad_on_rank_0_only(rank: int, world: int) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **KW, grad_worker_fraction=0.0)
    out: dict[str, Any] = {"raw": [], "after": [], "warnings": []}
    for x, y in batches(8):
        x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
        opt.zero_grad()
        F.cross_entropy(model(x, use_branch=rank == 0), y).backward()
        for name, p in model.named_parameters():
            if name.startswith("branch"):  # rank 0 alone has it; left unreduced
                continue
            dist.all_reduce(p.grad)
            p.grad /= world
        out["raw"].append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        out["warnings"] += [str(w.message) for w in caught]
        out["after"].append(
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
    return out


def test_gradient_on_some_ranks_only_is_left_alone_everywhere() -> None:
    results = run_distributed(2, grad_on_rank_0_only, timeout_s=60, pg_timeout_s=20)
    for step in range(3):
        raw, after = results[0]["raw"][step], results[0]["after"][step]
        assert torch.equal(after["branch.weight"], raw["branch.weight"])
        assert "branch.weight" not in results[1]["after"][step]
        for rank in range(2):
            r, a = results[rank]["raw"][step], results[rank]["after"][step]
            assert not torch.allclose(a["trunk.weight"], r["trunk.weight"])
            assert not torch.allclose(a["head.weight"], r["head.weight"])
    assert any("some ranks only" in w for w in results[0]["warnings"])


# -- topologies -----------------------------------------------------------------------------------


def train_plain(
    model: nn.Module, precond: KFACPreconditioner, data: list, group: Any = None, world: int = 1
) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {}
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
                p.grad /= world
        precond.step()
        record(model, precond, out)
        opt.step()
    return finish(model, precond, out)


def two_dp_groups(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    model = make_model()
    precond = KFACPreconditioner(model, **(KW | config), topology=Topology(dp=group))
    half = slice(4 * (rank % 2), 4 * (rank % 2) + 4)
    data = [(x[half], y[half]) for x, y in batches(8, seed=rank // 2)]
    return train_plain(model, precond, data, group, 2)


def test_two_data_parallel_groups_side_by_side() -> None:
    for config in CONFIGS:
        results = run_distributed(4, two_dp_groups, config, timeout_s=60, pg_timeout_s=20)
        for group in range(2):
            model = make_model()
            ref = train_plain(model, KFACPreconditioner(model, **(KW | config)), batches(8, group))
            for rank in (2 * group, 2 * group + 1):
                assert_same(results[rank], ref, f"group {group} rank {rank} {config}")
                assert results[rank]["grads"][0].keys() == ref["grads"][0].keys()


STAGES = {0: "trunk|branch", 1: "head"}  # the layers each pipeline stage holds


def pipeline_stage(rank: int, world: int, kl_clip: float | None) -> dict[str, Any]:
    """Both ranks hold the whole model and the same data, but each preconditions
    only its stage's layers (with a one-rank data-parallel group) and sends the
    result to the other, as stages' updates would stay on their own stage."""
    singles = [dist.new_group([r]) for r in range(world)]
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model,
        damping=0.01,
        kl_clip=kl_clip,
        skip_layers=[STAGES[1 - rank]],
        topology=Topology(dp=singles[rank], pp=dist.group.WORLD),
    )
    out: dict[str, Any] = {}
    for x, y in batches(8, seed=5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        for name, p in model.named_parameters():  # each stage's result from its owner
            owner = 0 if name.split(".")[0] in STAGES[0].split("|") else 1
            dist.broadcast(p.grad, src=owner)
        record(model, precond, out)
        opt.step()
    return finish(model, precond, out) | {"layers": list(precond.layers)}


@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_kl_clip_is_summed_over_pipeline_stages(kl_clip: float | None) -> None:
    results = run_distributed(2, pipeline_stage, kl_clip, timeout_s=60, pg_timeout_s=20)
    assert results[0]["layers"] == ["trunk", "branch"] and results[1]["layers"] == ["head"]
    model = make_model()
    ref = train_plain(
        model,
        KFACPreconditioner(model, damping=0.01, kl_clip=kl_clip),
        batches(8, seed=5),
    )
    for rank, got in enumerate(results):
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
            for n in r:
                assert rel(g[n], r[n]) <= TOL, f"rank {rank} step {step} {n}"
    if kl_clip is not None:  # the clip was active: the unclipped run differs
        model = make_model()
        free = train_plain(
            model, KFACPreconditioner(model, damping=0.01, kl_clip=None), batches(8, 5)
        )
        assert rel(free["grads"][0]["head.weight"], ref["grads"][0]["head.weight"]) > 1e-3


class _TwiceCheckpointed(nn.Module):
    """One Linear called twice inside a reentrant-checkpointed block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.cell(torch.tanh(self.cell(x))))

    def forward(self, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.block, x, use_reentrant=True) if checkpointed else self.block(x)
        return self.head(h)


def _reduced_cell_factor(rank: int, world: int, checkpointed: bool) -> torch.Tensor | None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = _TwiceCheckpointed().double()
    precond = KFACPreconditioner(model, **kfac_pytorch(damping=0.01, kl_clip=None))
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randint(0, 2, (4,), generator=g)
    F.cross_entropy(model(x, checkpointed), y).backward()
    precond.step()
    factor = precond.layers["cell"].factor("G")
    return None if factor is None else factor.clone()


def test_a_layer_recomputed_twice_by_reentrant_checkpointing_reduces_both_calls() -> None:
    """The first recomputed call's gradient completed the layer and sent its
    sums early, so the second call's were left out of the reduced G (0.13
    off on the owner); a layer with recomputed calls now waits for step()."""
    plain = run_distributed(2, _reduced_cell_factor, False)
    recomputed = run_distributed(2, _reduced_cell_factor, True)
    owners = [r for r in range(2) if plain[r] is not None]
    assert owners
    for r in owners:
        assert rel(recomputed[r], plain[r]) <= 1e-12
