"""A small decoder-only Transformer for character-level language modelling.

Attention is written out with separate ``nn.Linear`` projections for queries,
keys, values and output (rather than ``nn.MultiheadAttention``, whose fused
in-projection parameter and functional out-projection bypass module hooks), so
that K-FAC sees and preconditions every projection and both MLP layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "CausalSelfAttention", "CharTransformer"]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and the past."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:
            return proj(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q), heads(self.k), heads(self.v), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm Transformer block: attention then a 4× GELU MLP, both residual."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """Token and learned position embeddings, ``n_layers`` blocks, LayerNorm, Linear head.

    Input ``[batch, time]`` token ids; output ``[batch, time, vocab]`` logits.
    The head is not tied to the embedding so that each has its own K-FAC block.
    """

    def __init__(
        self, vocab_size: int, context: int, d_model: int, n_heads: int, n_layers: int
    ) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, n_heads) for _ in range(n_layers)))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        # GPT-2 style: small normal weights keep the initial logits near uniform.
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the context length {self.context}")
        # per-example position ids (not one broadcast row), so the position
        # embedding's K-FAC block sees each sequence's gradient
        positions = torch.arange(t, device=idx.device).expand(idx.shape[0], t)
        x = self.tok(idx) + self.pos(positions)
        return self.head(self.ln_f(self.blocks(x)))
