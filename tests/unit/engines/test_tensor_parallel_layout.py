"""Tensor parallelism without processes: how exact mode splits a gradient
matrix into shards and back (uneven ``torch.chunk`` shards included, down to
a rank holding none), and the greedy choice of each layer's primary rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisa.engines.tensor_parallel.engine import assign_primaries
from kaisa.engines.tensor_parallel.layout import ShardLayout
from kaisa.layers.linear import LinearAdapter
from kaisa.layers.tensor_parallel import ExactShardedAdapter, Sharding, Style, shard_range


class ShardOf(nn.Module):
    """What rank ``t`` holds of an ``nn.Linear(d_in, d_out)`` sharded by ``style``:
    the full sizes as attributes, the local shards as parameters with gradients."""

    def __init__(
        self, full: torch.Tensor, bias: torch.Tensor | None, style: Style, t: int, size: int
    ):
        super().__init__()
        self.out_features, self.in_features = full.shape
        part = (
            full[shard_range(full.shape[0], size, t)]
            if style is Style.COLWISE
            else full[:, shard_range(full.shape[1], size, t)]
        )
        self.weight = nn.Parameter(torch.zeros_like(part))
        self.weight.grad = part.clone()
        self.bias = None
        if bias is not None:
            b = bias[shard_range(bias.shape[0], size, t)] if style is Style.COLWISE else bias
            self.bias = nn.Parameter(torch.zeros_like(b))
            self.bias.grad = b.clone()


@pytest.mark.parametrize("style", list(Style))
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize(("d_out", "d_in", "size"), [(6, 4, 2), (7, 5, 3), (5, 5, 4), (3, 7, 4)])
def test_pieces_assemble_into_the_full_matrix_and_split_back(
    style: Style, has_bias: bool, d_out: int, d_in: int, size: int
) -> None:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    bias = torch.randn(d_out, generator=g, dtype=torch.float64) if has_bias else None
    ranks = [ShardOf(weight, bias, style, t, size) for t in range(size)]
    sharding = Sharding(style, d_in, d_out)
    layouts = [
        ShardLayout(ExactShardedAdapter(LinearAdapter("l", m), sharding, primary=0), size)
        for m in ranks
    ]
    full = weight if bias is None else torch.cat([weight, bias[:, None]], dim=1)

    pieces = torch.stack([lo.grad_piece() for lo in layouts])
    assert pieces.shape[1] == layouts[0].grad_piece_numel
    assert torch.equal(layouts[0].assemble(pieces), full)

    preconditioned = torch.randn(full.shape, generator=g, dtype=torch.float64)
    split = layouts[0].split(preconditioned)
    for t, (m, lo) in enumerate(zip(ranks, layouts)):
        assert split[t].numel() == lo.out_piece_numel
        lo.write(split[t], t)
        if style is Style.COLWISE:
            rows = shard_range(d_out, size, t)
            assert torch.equal(m.weight.grad, preconditioned[rows, :d_in])
            if bias is not None:
                assert torch.equal(m.bias.grad, preconditioned[rows, d_in])
        else:
            cols = shard_range(d_in, size, t)
            assert torch.equal(m.weight.grad, preconditioned[:, cols])
            if bias is not None:  # the replicated bias: the same column on every rank
                assert torch.equal(m.bias.grad, preconditioned[:, d_in])


def test_primaries_spread_the_work_greedily() -> None:
    assert assign_primaries([8.0, 1.0, 1.0, 8.0], 2) == [0, 0, 1, 1]
    assert assign_primaries([5.0, 4.0, 3.0], 3) == [0, 1, 2]
    assert assign_primaries([1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 0, 1]
    assert assign_primaries([], 2) == []
    loads = [0.0, 0.0]
    costs = [27.0, 8.0, 64.0, 1.0, 27.0]
    for cost, rank in zip(costs, assign_primaries(costs, 2)):
        loads[rank] += cost
    assert max(loads) == 64.0  # the largest alone; everything else on the other rank
