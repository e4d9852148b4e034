"""A Transformer with attention (self and cross), embeddings (one with
padding_idx) and a tied LM head: every KAISA strategy on W gloo ranks equals
the single process on the same global batches (float64, ≤ 1e-10)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa import KFACPreconditioner
from kfac_defaults import kfac_pytorch

from harness import run_distributed

pytestmark = pytest.mark.distributed

VOCAB, D, T, B, STEPS = 17, 8, 5, 2, 3  # B sequences per rank


class TinySeq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, D, padding_idx=0)
        self.pos = nn.Embedding(T, D)
        self.enc = nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoderLayer(D, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(T).expand(src.shape[0], T)
        memory = self.enc(self.tok(src) + self.pos(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.bool)
        return self.head(self.dec(self.tok(tgt) + self.pos(positions), memory, tgt_mask=mask))


def batches(world: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        src = torch.randint(0, VOCAB, (world * B, T), generator=g)
        src[:, -1] = 0  # padding
        tgt = torch.randint(1, VOCAB, (world * B, T), generator=g)
        out.append((src, tgt, torch.roll(tgt, -1, dims=1)))
    return out


def train(rank: int, world: int, options: dict[str, Any]) -> list[torch.Tensor]:
    torch.set_default_dtype(torch.float64)
    model = TinySeq2Seq()
    net: nn.Module = DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        net,
        optimizer=opt,
        loss_average="batch_and_sequence",
        # written for kfac-pytorch's values: factors every step, the eigen method
        **kfac_pytorch(damping=0.01, kl_clip=0.05, inv_update_steps=2, **options),
    )
    assert {"tok", "dec.multihead_attn.k", "enc.self_attn.out_proj"} & set(precond.layers) == {
        "dec.multihead_attn.k",
        "enc.self_attn.out_proj",
    } and "head" in precond.layers
    for src, tgt, y in batches(world):
        mine = slice(rank * B, (rank + 1) * B)
        opt.zero_grad()
        logits = net(src[mine], tgt[mine])
        F.cross_entropy(logits.reshape(-1, VOCAB), y[mine].reshape(-1)).backward()
        precond.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def single(world: int, options: dict[str, Any]) -> list[torch.Tensor]:
    """One process, the world's batches whole, the same options."""
    global B
    previous, saved, B = torch.get_default_dtype(), B, world * B
    try:
        return train(0, 1, options)
    finally:
        B = saved
        torch.set_default_dtype(previous)


@pytest.mark.parametrize(
    "world,options",
    [
        (2, {"grad_worker_fraction": 1.0}),
        (2, {"grad_worker_fraction": 0.5, "compute_method": "inverse"}),
        (4, {"grad_worker_fraction": 0.5, "symmetry_aware": True}),
        (2, {"grad_worker_fraction": 0.5, "factor_position_fraction": 0.4}),
        (4, {"grad_worker_fraction": 0.0, "factor_position_fraction": 0.4}),
    ],
    ids=["w2-comm-opt", "w2-mem-opt-inverse", "w4-hybrid", "w2-positions", "w4-mem-opt-positions"],
)
def test_transformer_strategies_equal_single_process(world: int, options: dict) -> None:
    want = single(world, options)
    for got in run_distributed(world, train, options):
        for a, b in zip(got, want):
            assert float((a - b).norm() / b.norm()) <= 1e-10
