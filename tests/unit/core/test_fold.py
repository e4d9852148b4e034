"""Every factor of a step folded into its running average at once
(kaisa.core.statistics.fold_averages_): the same averages as one at a time,
a non-finite batch left out, and a constant number of kernels per device
and dtype — not ten per factor, which made an accelerator's factor step
launch-bound."""

from __future__ import annotations

import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kaisa.core.statistics import fold_averages_


def gram(d: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(3 * d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (x.t() @ x).to(dtype)


def test_fold_equals_the_running_average_of_each() -> None:
    decay = 0.9
    shapes = [(5, torch.float32), (7, torch.float64), (3, torch.float32), (4, torch.float64)]
    runnings: list[torch.Tensor | None] = [gram(d, i, t) for i, (d, t) in enumerate(shapes)]
    runnings.append(None)  # a factor seen for the first time
    batches = [gram(d, 10 + i, t) for i, (d, t) in enumerate(shapes)] + [gram(6, 20, torch.float32)]
    batches.append(torch.rand(8, dtype=torch.float64))  # a diagonal (vector) factor
    runnings.append(torch.rand(8, dtype=torch.float64))
    counts = [2.0, 3.0, 5.0, 7.0, 11.0, 13.0]
    want = [
        None if r is None else decay * r.double() + (1 - decay) * b.double() / c
        for r, b, c in zip(runnings, batches, counts)
    ]
    first = batches[4].double() / counts[4]
    verdicts = fold_averages_(runnings, batches, counts, decay)
    assert verdicts == [True] * 6
    for r, w in zip(runnings, want):
        if r is not None and w is not None:
            assert torch.allclose(r.double(), w, rtol=1e-6, atol=0)
    assert torch.allclose(batches[4].double(), first, rtol=1e-6)  # divided, left to the caller


def test_a_non_finite_batch_leaves_its_average_alone() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        runnings: list[torch.Tensor | None] = [gram(4, 0, torch.float32), gram(4, 1, torch.float32)]
        runnings.append(torch.ones(6))
        kept = [r.clone() for r in runnings if r is not None]
        batches = [gram(4, 2, torch.float32), gram(4, 3, torch.float32), torch.ones(6)]
        batches[1][2, 2] = bad  # a Gram is non-finite on its diagonal wherever it is
        batches[2][5] = bad
        verdicts = fold_averages_(runnings, batches, [1.0, 1.0, 1.0], 0.5)
        assert verdicts == [True, False, False], bad
        assert not torch.equal(runnings[0], kept[0])
        assert torch.equal(runnings[1], kept[1]) and torch.equal(runnings[2], kept[2])


def test_the_fold_is_a_few_multi_tensor_kernels_whatever_the_factor_count() -> None:
    n = 24
    runnings: list[torch.Tensor | None] = [gram(3 + i % 5, i, torch.float32) for i in range(n)]
    batches = [gram(3 + i % 5, 100 + i, torch.float32) for i in range(n)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fold_averages_(runnings, batches, [2.0] * n, 0.95)
    ops = collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)
    # views (the diagonals checked on CPU) and tolist()'s conjugate/negation
    # resolution launch nothing; the rest is one kernel each for all 24
    views = ("aten::diagonal", "aten::resolve_conj", "aten::resolve_neg")
    kernels = {k: v for k, v in ops.items() if k not in views}
    assert kernels == {
        "aten::_foreach_div_": 1,
        "aten::_foreach_norm": 1,
        "aten::stack": 1,
        "aten::isfinite": 1,
        "aten::_foreach_lerp_": 1,
    }, kernels
