"""A compiled ``step()`` (issue 24): ``precond.compile()`` and ``torch.compile(precond.step)``.

1. ``precond.compile()`` runs the stacked groups' kernel (kaisa.step.batched)
   compiled: the same gradients as without (float64, eigen and inverse,
   across factor and inverse updates, with a damping schedule), two
   compilations in all however many steps, dampings and group shapes (the
   second is dynamic in shape: eleven shapes do not reach dynamo's
   recompile limit, which ``fullgraph`` would make an error), no break.
2. ``torch.compile(precond.step)`` — the whole step under dynamo, with its
   breaks at the collectives and decisions — trains as the eager step does.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from compiled_case import Counting
from kaisa import KFACPreconditioner
from kaisa.torch_support import COMPILE_FLOOR

pytestmark = pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def tower() -> nn.Module:
    """Two groups of stacked layers (4 × 16→16, 2 × 16→8 after them) and a head."""
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    layers += [nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh()]
    layers += [nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers).double()


def run(model: nn.Module, stepper: Any, precond: KFACPreconditioner, steps: int = 9) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(12, 16, generator=g, dtype=torch.float64)
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        stepper()
        opt.step()


KW: dict[str, Any] = dict(
    factor_update_steps=2, inv_update_steps=4, damping=lambda s: 0.1 + 0.01 * s, lr=0.05
)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_compiled_groups_equal_the_eager_step(method: str) -> None:
    torch.manual_seed(0)
    eager = tower()
    model = copy.deepcopy(eager)
    want = KFACPreconditioner(eager, compute_method=method, **KW)
    got = KFACPreconditioner(model, compute_method=method, **KW)
    groups = got._parts.pipeline.application.groups
    backend = Counting()
    got.compile(backend=backend)
    counters.clear()
    run(eager, want.step, want)
    run(model, got.step, got)
    assert groups.split(list(got.layers.values()))  # the tower's layers were stacked
    assert backend.compiled == 2  # two group shapes, damping changing every step
    assert backend.runs == 2 * 9
    assert not counters["graph_break"]
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_many_group_shapes_compile_twice_not_once_each() -> None:
    """Eleven group shapes (three layers of each width): the first compiles a
    graph, the second a dynamic-shape one that serves the rest — no error at
    dynamo's recompile limit of 8, and the same gradients as without."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for w0, w1 in itertools.pairwise(range(6, 18)):
        layers += [nn.Linear(w0, w1), nn.Tanh(), nn.Linear(w1, w1), nn.Tanh()]
        layers += [nn.Linear(w1, w1), nn.Tanh()]
    eager = nn.Sequential(*layers).double()
    model = copy.deepcopy(eager)
    want = KFACPreconditioner(eager, **KW)
    got = KFACPreconditioner(model, **KW)
    backend = Counting()
    got.compile(backend=backend)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        for net, precond in ((eager, want), (model, got)):
            net.zero_grad()
            net(x).pow(2).mean().backward()
            precond.step()
        for a, b in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
    groups = got._parts.pipeline.application.groups.split(list(got.layers.values()))
    assert len(groups) == 11
    assert backend.compiled == 2 and backend.runs == 5 * 11


def test_torch_compile_of_step_trains_as_the_eager_step() -> None:
    torch.manual_seed(0)
    eager = tower()
    model = copy.deepcopy(eager)
    want = KFACPreconditioner(eager, **KW)
    got = KFACPreconditioner(model, **KW)
    run(eager, want.step, want)
    run(model, torch.compile(got.step, backend="aot_eager"), got)
    assert got.steps == want.steps == 9
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
