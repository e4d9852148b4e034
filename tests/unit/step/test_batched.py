"""Layers of one shape preconditioned together (kaisa.step.batched).

1. A stacked group equals its layers preconditioned one by one (float64,
   ≤ 1e-12), for the eigen method with and without the eigenvalue outer
   product and for the inverse method, across inverse updates (the stacks
   are rebuilt from the new decompositions).
2. Which layers are stacked: those sharing every shape, with dense factors
   and small operands, where every rank is every layer's worker.
3. The products a step runs grow with the number of distinct shapes, not
   with the number of layers (profiler op counts of a non-factor step).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from kaisa import KFACPreconditioner
from kaisa.step import batched
from kaisa.step.batched import ShapeGroups


def tower(blocks: int, width: int = 6) -> nn.Module:
    """``blocks`` identical Linear+Tanh blocks, then a head of another shape."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 3)).double()


def run(model: nn.Module, steps: int, stacked: bool, **kw: Any) -> KFACPreconditioner:
    precond = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=2, damping=0.05, kl_clip=0.01, **kw
    )
    if not stacked:
        precond._parts.pipeline.application.groups = _NoGroups(precond)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        F.cross_entropy(model(x), torch.randint(0, 3, (16,), generator=g)).backward()
        precond.step()
        opt.step()
    return precond


class _NoGroups(ShapeGroups):
    def __init__(self, precond: KFACPreconditioner) -> None:
        super().__init__(precond._parts.pipeline.application.method)

    def split(self, layers: Any) -> list[Any]:
        return []


@pytest.mark.parametrize(
    "kw",
    [
        dict(compute_method="eigen"),
        dict(compute_method="eigen", compute_eigenvalue_outer_product=False),
        dict(compute_method="inverse"),
    ],
    ids=["eigen", "eigen-no-outer", "inverse"],
)
def test_stacked_groups_equal_layer_by_layer(kw: dict[str, Any]) -> None:
    a, b = tower(4), tower(4)
    stacked = run(a, 5, True, **kw)
    run(b, 5, False, **kw)
    groups = stacked._parts.pipeline.application.groups
    assert groups.nbytes() > 0  # the four blocks were stacked
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert float((pa - pb).norm() / pb.norm()) <= 1e-12


def test_which_layers_are_stacked() -> None:
    model = nn.Sequential(
        nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6, bias=False), nn.Linear(6, 6)
    ).double()
    precond = KFACPreconditioner(model, damping=0.1)
    F.mse_loss(
        model(torch.randn(8, 6, dtype=torch.float64)), torch.zeros(8, 6, dtype=torch.float64)
    ).backward()
    precond.step()
    groups = precond._parts.pipeline.application.groups
    layers = list(precond.layers.values())
    found = groups.split(layers)
    assert [[la.name for la in g] for g in found] == [["0", "1", "3"]]  # "2" has no bias
    # a method without the capability (EKFAC: its divisor is not checked
    # stacked) is wired with none, and forms no group
    from kaisa.methods.capabilities import StackedApply
    from kaisa.methods.ekfac import EKFACMethod

    assert isinstance(precond._parts.pipeline.application.method, StackedApply)
    assert not isinstance(EKFACMethod(), StackedApply)
    assert ShapeGroups(None).split(layers) == []


def test_large_operands_are_not_stacked(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tower(3)
    precond = run(model, 1, True)
    layers = list(precond.layers.values())
    assert precond._parts.pipeline.application.groups.split(layers)
    monkeypatch.setattr(batched, "MAX_OPERAND_NUMEL", 6 * 7 - 1)  # A of a block is 7 x 7
    assert not precond._parts.pipeline.application.groups.split(layers)


@pytest.mark.parametrize(
    "kw",
    [
        dict(compute_method="eigen"),
        dict(compute_method="inverse"),
        dict(compute_method="eigen", precondition_dtype=torch.float32),
    ],
    ids=["eigen", "inverse", "cast-copies"],
)
def test_stacked_operands_are_counted_and_forecast(kw: dict[str, Any]) -> None:
    """memory_usage()['stacked'] is the copy the groups hold, and the planner's
    forecast predicts it (and so the total) exactly."""
    from kaisa.planner.forecast import forecast, layer_costs

    model = nn.Sequential(tower(3), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    precond = run(model, 3, True, **kw)
    mem = precond.memory_usage()
    held = precond._parts.pipeline.application.groups.nbytes()
    assert mem["stacked"] == held > 0
    predicted = forecast(layer_costs(model, **kw), 1, **kw)
    assert int(predicted.memory["stacked"][0]) == mem["stacked"]
    assert int(predicted.memory["total"][0]) == mem["total"]


#: operators that only make views or metadata (no kernel on an accelerator)
VIEWS = {
    "aten::" + name
    for name in [
        "as_strided",
        "reshape",
        "view",
        "unsqueeze",
        "squeeze",
        "select",
        "slice",
        "_reshape_alias",
        "expand",
        "transpose",
        "t",
        "detach",
        "alias",
        "resolve_conj",
        "resolve_neg",
        "to",
        "empty",
        "empty_strided",
        "permute",
        "diagonal",
        "unbind",
        "split",
        "chunk",
        "_unsafe_view",
        "view_as",
        "lift_fresh",
        "detach_",
    ]
}


def _ops(blocks: int, read_scalars: bool | None = None) -> tuple[Counter[str], Counter[str]]:
    """Every operator, and the top-level ones that launch kernels (a foreach
    operator counts once, as it is one multi-tensor launch on a GPU), of one
    non-factor K-FAC step of ``tower(blocks)``."""
    model = tower(blocks)
    precond = run(model, 3, True)  # the next step (3) is not a factor step at 2/4
    precond._parts.pipeline.application.read_scalars = read_scalars
    precond.factor_update_steps = 2
    precond.inv_update_steps = 4
    model.zero_grad()
    x = torch.randn(16, 6, dtype=torch.float64)
    F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        precond.step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = Counter(
        e.name
        for e in events
        if e.name not in VIEWS
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )
    return Counter(e.name for e in events), top


def test_products_grow_with_shapes_not_layers() -> None:
    def products(blocks: int) -> int:
        ops = _ops(blocks)[0]
        return sum(ops[name] for name in ("aten::mm", "aten::bmm", "aten::matmul"))

    assert products(8) == products(2)


def test_launches_grow_with_shapes_not_layers() -> None:
    """Under an accelerator's rule (no host reads) a non-factor step launches
    as many kernels for 8 identical blocks as for 2: gradients read stacked,
    one product per factor per group, ν and the writes as foreach operators."""
    few, many = _ops(2, read_scalars=False)[1], _ops(8, read_scalars=False)[1]
    assert many == few, (many - few) + (few - many)
