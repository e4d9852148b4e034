"""Factor statistics from a fraction of the positions (``factor_position_fraction``).

Each against its dense float64 definition: A the mean of the kept rows'
``[a, 1][a, 1]ᵀ``; G the Gram of a backward whose output gradient is the
true one at the kept positions, weighted ``sqrt(T/k)``, and zero elsewhere
(G sums over positions, so it stays unbiased).  The draws are a function of
(seed, step, layer, factor): the same for every call of a step, fresh at
each factor step, and reproduced by a resumed run.  Distributed runs equal
the single process (tests/distributed/test_invariance.py,
test_transformer_invariance.py).
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import zlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.core.positions import PositionSampler, _name_code

F64: dict[str, Any] = dict(
    damping=0.05,
    lr=0.1,
    factor_dtype=torch.float64,
    factor_compute_dtype=torch.float64,
    inv_dtype=torch.float64,
    factor_update_steps=1,
    inv_update_steps=1,
)


def _sequence_net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 3)).double(), torch.randn(4, 8, 5, dtype=torch.float64)


def _one_step(
    net: nn.Module, x: torch.Tensor, **options: Any
) -> tuple[KFACPreconditioner, KFACPreconditioner, nn.Module, torch.Tensor]:
    """One factor step of ``net`` under ``options``: its preconditioner, a
    float64 twin's at every position (not stepped yet), the twin, and the
    output gradient the step saw."""
    twin = copy.deepcopy(net)
    precond = KFACPreconditioner(net, **F64, **options)
    reference = KFACPreconditioner(twin, **F64)
    out = net(x)
    grads: list[torch.Tensor] = []
    out.register_hook(grads.append)
    out.square().mean().backward()
    precond.step()
    return precond, reference, twin, grads[0]


def _factor(precond: KFACPreconditioner, name: str) -> torch.Tensor:
    found = next(iter(precond.layers.values())).factor(name)
    assert found is not None
    return found


def test_a_sequence_layers_factors_are_those_of_the_kept_positions() -> None:
    net, x = _sequence_net()
    precond, reference, twin, grad = _one_step(
        net, x, factor_position_fraction=0.375, factor_position_seed=5
    )
    draws = PositionSampler(0.375, 5)
    kept_a, kept_g = (draws.kept(name, 8) for name in ("A", "G"))
    assert kept_a is not None and kept_g is not None and len(kept_a) == 3
    assert not torch.equal(kept_a, kept_g)  # each factor draws its own
    rows = torch.cat([x[:, kept_a].reshape(-1, 5), torch.ones(12, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(_factor(precond, "A"), rows.T @ rows / 12, rtol=1e-12, atol=0)
    mask = torch.zeros(1, 8, 1, dtype=torch.float64)
    mask[0, kept_g] = (8 / 3) ** 0.5
    twin(x).backward(grad * mask)
    reference.step()
    torch.testing.assert_close(_factor(precond, "G"), _factor(reference, "G"), rtol=1e-12, atol=0)


def test_block_diagonal_factors_keep_the_kept_positions_blocks() -> None:
    """With ``large_factor='block'`` (the leanest step sets both): each kept
    factor is the kept positions' dense factor with its off-block entries zeroed."""
    from kaisa.core.specs import FactorKind

    net, x = _sequence_net()
    precond, reference, twin, grad = _one_step(
        net, x, factor_position_fraction=0.375, max_factor_dim=2, large_factor="block"
    )
    draws = PositionSampler(0.375)
    kept_a, kept_g = (draws.kept(name, 8) for name in ("A", "G"))
    assert kept_a is not None and kept_g is not None
    rows = torch.cat([x[:, kept_a].reshape(-1, 5), torch.ones(12, 1, dtype=torch.float64)], 1)
    mask = torch.zeros(1, 8, 1, dtype=torch.float64)
    mask[0, kept_g] = (8 / 3) ** 0.5
    twin(x).backward(grad * mask)
    reference.step()
    layer = next(iter(precond.layers.values()))
    for spec, dense in zip(layer.factors, (rows.T @ rows / 12, _factor(reference, "G"))):
        assert spec.kind is FactorKind.BLOCK_DIAGONAL
        blocks = torch.block_diag(*(torch.ones(b, b) for b in spec.layout.sizes())).double()
        torch.testing.assert_close(
            spec.layout.dense(_factor(precond, spec.name)), dense * blocks, rtol=1e-12, atol=0
        )


@pytest.mark.parametrize("fraction", [1.0, 0.9])
def test_a_fraction_keeping_every_position_leaves_the_factors_as_they_were(
    fraction: float,
) -> None:
    """1, or ⌈0.9·8⌉ = 8: nothing is cut (and a one-position call never is)."""
    net, x = _sequence_net()
    precond, reference, twin, _ = _one_step(net, x, factor_position_fraction=fraction)
    twin(x).square().mean().backward()
    reference.step()
    for name in ("A", "G"):
        assert torch.equal(_factor(precond, name), _factor(reference, name))


@pytest.mark.parametrize("dims", [1, 2])
def test_a_convolutions_factors_are_those_of_its_kept_output_positions(dims: int) -> None:
    """A: the mean of [patch, 1][patch, 1]ᵀ over the kept output positions'
    windows (padding and dilation included); G as for a sequence layer."""
    torch.manual_seed(2)
    if dims == 1:
        net: nn.Module = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1, dilation=2)).double()
        x = torch.randn(2, 3, 9, dtype=torch.float64)
    else:
        net = nn.Sequential(nn.Conv2d(2, 3, (2, 3), padding=(1, 0))).double()
        x = torch.randn(2, 2, 5, 6, dtype=torch.float64)
    precond, reference, twin, grad = _one_step(
        net, x, factor_position_fraction=0.4, factor_position_seed=7
    )
    positions = grad[0, 0].numel()
    draws = PositionSampler(0.4, 7)
    kept_a, kept_g = (draws.kept(name, positions) for name in ("A", "G"))
    assert kept_a is not None and kept_g is not None
    assert len(kept_a) == math.ceil(0.4 * positions)
    # the windows by unfold: [N, L, C·K] in the weight's (c, k…) order
    if dims == 1:
        padded = F.pad(x, (1, 1))
        windows = padded.unfold(2, 5, 1)[..., ::2].permute(0, 2, 1, 3).reshape(2, -1, 9)
    else:
        windows = F.unfold(x, (2, 3), padding=(1, 0)).transpose(1, 2)
    rows = windows[:, kept_a].reshape(-1, windows.shape[-1])
    rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=torch.float64)], 1)
    want_a = rows.T @ rows / rows.shape[0]
    torch.testing.assert_close(_factor(precond, "A"), want_a, rtol=1e-12, atol=1e-15)
    mask = torch.zeros(positions, dtype=torch.float64)
    mask[kept_g] = (positions / len(kept_g)) ** 0.5
    twin(x).backward(grad * mask.reshape(grad.shape[2:]))
    reference.step()
    torch.testing.assert_close(
        _factor(precond, "G"), _factor(reference, "G"), rtol=1e-12, atol=1e-15
    )


def test_an_embeddings_g_is_cut_and_its_token_counts_are_not() -> None:
    """An Embedding's A counts tokens (a diagonal, no Gram to save): every
    token is counted; its G is the kept positions' as for a Linear."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Embedding(11, 4)).double()
    ids = torch.randint(0, 11, (3, 10))
    precond, reference, twin, grad = _one_step(net, ids, factor_position_fraction=0.3)
    counts = torch.bincount(ids.reshape(-1), minlength=11).double() / ids.numel()
    torch.testing.assert_close(_factor(precond, "A"), counts, rtol=1e-12, atol=0)
    kept_g = PositionSampler(0.3).kept("G", 10)
    assert kept_g is not None
    mask = torch.zeros(1, 10, 1, dtype=torch.float64)
    mask[0, kept_g] = (10 / 3) ** 0.5
    twin(ids).backward(grad * mask)
    reference.step()
    torch.testing.assert_close(_factor(precond, "G"), _factor(reference, "G"), rtol=1e-12, atol=0)


def _run(steps: int, micro: int = 1, state: dict | None = None, **options: Any):
    """``steps`` SGD + K-FAC steps of a two-layer sequence model (factors every
    step, so every step draws), each batch split into ``micro`` micro-batches;
    ``state``: resume from it at its step.  Returns (parameters, state)."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        net, optimizer=opt, accumulation_steps=micro, **F64 | {"inv_update_steps": 2} | options
    )
    g = torch.Generator().manual_seed(9)
    data = [torch.randn(4, 8, 5, generator=g, dtype=torch.float64) for _ in range(steps)]
    start = 0
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        precond.load_state_dict(state["precond"])
        start = precond.steps
    saved = None
    for i in range(start, steps):
        opt.zero_grad()
        for chunk in data[i].chunk(micro):
            (net(chunk).square().mean() / micro).backward()
        precond.step()
        opt.step()
        if i == 2:
            saved = copy.deepcopy(
                {
                    "model": net.state_dict(),
                    "opt": opt.state_dict(),
                    "precond": precond.state_dict(),
                }
            )
    return [p.detach().clone() for p in net.parameters()], saved


def test_every_factor_step_draws_afresh_and_a_seed_sets_the_draws() -> None:
    a = PositionSampler(0.25, seed=1)
    first = a.kept("A", 64)
    assert first is not None and len(first) == 16
    a.step = 10
    assert not torch.equal(first, a.kept("A", 64))
    a.step = 0
    assert torch.equal(first, a.kept("A", 64))
    assert not torch.equal(first, PositionSampler(0.25, seed=2).kept("A", 64))
    assert not torch.equal(first, a.kept("G", 64))
    base, _ = _run(5)
    one, _ = _run(5, factor_position_fraction=0.25, factor_position_seed=1)
    other, _ = _run(5, factor_position_fraction=0.25, factor_position_seed=2)
    assert all(not torch.equal(x, y) for x, y in zip(one, other))
    assert all(not torch.equal(x, y) for x, y in zip(one, base))


def test_the_draws_spread_over_every_position_alike() -> None:
    """Over many factor steps each position is read about ``f`` of the time,
    and pairs of positions about ``f²`` of the time (a draw that favoured some
    positions, or moved them in blocks, would bias the factors it cuts)."""
    sampler = PositionSampler(0.25, seed=11)
    steps, positions = 2000, 64
    picked = torch.zeros(steps, positions)
    for step in range(steps):
        sampler.step = step
        kept = sampler.kept("G", positions)
        assert kept is not None and len(kept) == 16 and bool((kept.diff() > 0).all())
        picked[step, kept] = 1.0
    share = picked.mean(0)  # binomial: sd sqrt(0.25·0.75/2000) ≈ 0.0097
    assert float((share - 0.25).abs().max()) < 0.05, share
    pairs = (picked.T @ picked / steps).fill_diagonal_(0.0625)  # 16·15/(64·63) ≈ 0.0595 each
    assert float((pairs - 0.0625).abs().max()) < 0.03


def test_a_factors_name_enters_the_draw_as_the_same_number_in_every_process() -> None:
    """The name's number is its CRC-32: the same in every process (ranks,
    a resumed run), unlike ``hash``, which Python salts per process."""
    names = ["A", "G", "", "blocks.0.attn.q/A", "Gé"]
    probe = (
        f"from kaisa.core.positions import _name_code; print([_name_code(n) for n in {names!r}])"
    )
    for salt in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": salt}
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
        )
        assert out.stdout.strip() == str([_name_code(n) for n in names])
    assert [_name_code(n) for n in names] == [zlib.crc32(n.encode()) for n in names]


def test_a_draw_for_a_name_first_seen_in_a_graph_is_the_host_draw() -> None:
    """A factor name kaisa does not use is looked up in eager code only after
    its first draw; drawn first inside a compiled region, it still gives the
    host's positions."""
    torch._dynamo.reset()
    sampler = PositionSampler(0.3, seed=4)
    sampler.place(torch.device("cpu"))
    name = f"new-{os.getpid()}"
    drawn = torch.compile(lambda: sampler.kept(name, 50), backend="eager")()
    host = sampler.kept(name, 50)
    assert host is not None and drawn is not None and torch.equal(drawn, host)
    torch._dynamo.reset()


def test_a_draw_on_another_device_or_in_a_graph_is_the_host_draw() -> None:
    """The draw is integer arithmetic on the layer's device, the same in a
    compiled graph as in eager code (its key a graph input: one graph for
    every step)."""
    torch._dynamo.reset()
    sampler = PositionSampler(0.3, seed=4)
    sampler.place(torch.device("cpu"))
    draw = torch.compile(lambda: sampler.kept("A", 50), backend="eager", fullgraph=True)
    for step in (0, 7, 2**40):
        sampler.step = step
        host = sampler.kept("A", 50)
        assert host is not None and torch.equal(draw(), host)
        if torch.cuda.is_available():
            assert torch.equal(sampler.kept("A", 50, "cuda").cpu(), host)
    torch._dynamo.reset()


def test_micro_batches_read_the_positions_of_the_whole_batch() -> None:
    """Every call of a step reads the same positions, so splitting a batch
    into micro-batches changes nothing but the rounding."""
    whole, _ = _run(4, factor_position_fraction=0.25)
    split, _ = _run(4, micro=2, factor_position_fraction=0.25)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_resumed_run_draws_what_the_uninterrupted_run_drew() -> None:
    whole, state = _run(6, factor_position_fraction=0.25, factor_position_seed=3)
    resumed, _ = _run(6, state=state, factor_position_fraction=0.25, factor_position_seed=3)
    for a, b in zip(whole, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(factor_position_fraction=0.0), r"factor_position_fraction must be in \(0.0, 1.0\]"),
        (dict(factor_position_fraction=1.5), r"factor_position_fraction must be in \(0.0, 1.0\]"),
        (dict(factor_position_fraction="half"), r"factor_position_fraction must be a number"),
        (dict(factor_position_seed=-1), r"factor_position_seed must be in \[0, inf\)"),
        (dict(factor_position_seed=0.5), r"factor_position_seed must be an int"),
        (
            dict(factor_position_fraction=0.5, kfac_approx="reduce"),
            r"kfac_approx='reduce' already forms one row per data point",
        ),
    ],
)
def test_bad_position_options_are_refused_by_name(options: dict, message: str) -> None:
    net, _ = _sequence_net()
    with pytest.raises((ValueError, TypeError), match=message):
        KFACPreconditioner(net, **options)


def test_a_self_attentions_q_k_v_read_one_draw_of_their_shared_input() -> None:
    """q, k and v read one input: their A terms are one term whichever layer
    forms it (a step's draw is every layer's); G reads other positions, and
    each layer's G its own output gradient."""
    torch.manual_seed(6)
    net = nn.MultiheadAttention(4, 2, batch_first=True).double()
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    precond = KFACPreconditioner(net, **F64, factor_position_fraction=0.3)
    net(x, x, x, need_weights=False)[0].square().mean().backward()
    precond.step()
    a = {role: precond.layers[role].factor("A") for role in ("q", "k", "v")}
    assert torch.equal(a["q"], a["k"]) and torch.equal(a["q"], a["v"])
    kept = PositionSampler(0.3).kept("A", 10)
    assert kept is not None
    rows = torch.cat([x[:, kept].reshape(-1, 4), torch.ones(9, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(a["q"], rows.T @ rows / 9, rtol=1e-12, atol=0)
    g = [precond.layers[role].factor("G") for role in ("q", "k", "v")]
    assert not torch.equal(g[0], g[1])
