"""A causal dilated convolutional network for character-level language modelling.

Every weight is shared by all 64 positions of a window, so a batch of 32 gives each
layer 2,048 rows, as in the Transformer: the forward and backward grow with
the rows, the preconditioning products do not.  ByteNet/WaveNet-style
blocks: a causal convolution of width 3 at dilations 1, 2, 4, 8 (receptive
field 31 characters), GELU, a 1×1 convolution back, and a residual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CausalConvBlock", "CharConvNet"]


class CausalConvBlock(nn.Module):
    """``x + W₂ GELU(W₁ ⋆ x)``, where ``W₁ ⋆`` sees only the past.

    The causal padding is applied to the input before the convolution (whose
    own padding is 0), so position ``t`` depends on ``t - dilation·(k-1) … t``.
    """

    def __init__(self, channels: int, hidden: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.left = dilation * (kernel - 1)
        self.conv = nn.Conv1d(channels, hidden, kernel, dilation=dilation)
        self.proj = nn.Conv1d(hidden, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.conv(F.pad(x, (self.left, 0)))))


class CharConvNet(nn.Module):
    """Token embedding, causal blocks over ``[batch, channels, time]``, LayerNorm, head.

    Input ``[batch, time]`` token ids; output ``[batch, time, vocab]`` logits.
    """

    def __init__(
        self,
        vocab_size: int,
        channels: int = 128,
        hidden: int = 256,
        kernel: int = 3,
        dilations: tuple[int, ...] = (1, 2, 4, 8),
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, channels)
        blocks = [CausalConvBlock(channels, hidden, kernel, d) for d in dilations]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, vocab_size)
        nn.init.normal_(self.tok.weight, std=0.02)
        for block in blocks:
            # each residual branch starts small, so the stack starts near the identity
            nn.init.normal_(block.proj.weight, std=0.02)
            assert block.proj.bias is not None
            nn.init.zeros_(block.proj.bias)
        #: how many characters (the current one included) a prediction can see
        self.receptive_field = 1 + sum(block.left for block in blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).transpose(1, 2)  # [batch, channels, time]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.transpose(1, 2)))
