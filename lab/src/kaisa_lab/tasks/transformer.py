"""A small decoder-only Transformer for character-level language modelling.

Its blocks are ``nn.TransformerEncoderLayer`` (pre-LayerNorm, GELU, causal
mask), the layer people use: kaisa preconditions their packed attention
projections (q, k, v), the out-projection and both MLP layers, as well as the
token and position embeddings and the head.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["CharTransformer"]


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
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model,
                n_heads,
                dim_feedforward=4 * d_model,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(n_layers)
        )
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
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        return self.head(self.ln_f(x))
