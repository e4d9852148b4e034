"""The models the cost cases time, in one place so every case times the same ones.

- :func:`mlp` and :func:`cnn`: the field notes' 784-512-512-10 MLP and small
  CNN on 1×28×28 inputs (:data:`STEP_MODELS`, batch 128 in ``step-cost`` and
  ``precision``). The CNN's activations are not in place: kfac-pytorch's full
  backward hooks refuse an in-place op right after a layer, and both
  libraries must time one model.
- :func:`cnn32`: the CNN on 3×32×32 inputs (3 conv + 2 linear, ReLUs in
  place) of ``conv-capture`` and ``compile-step``.
- :class:`LM` (pre-norm blocks with plain ``nn.Linear`` projections) and
  :class:`EncoderLM` (the same built from ``nn.TransformerEncoderLayer``):
  the Transformer LMs of ``compile-step`` (:func:`compile_models`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LM",
    "STEP_MODELS",
    "Block",
    "CompileModel",
    "EncoderLM",
    "cnn",
    "cnn32",
    "compile_models",
    "loss_of",
    "mlp",
]


def mlp() -> nn.Module:
    """784-512-512-10 on 1×28×28 inputs (flattened)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def cnn() -> nn.Module:
    """3 conv (1→32→32→64, two 2×2 pools) + Linear 3136→128 + Linear 128→10 on 1×28×28."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 7 * 7, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


#: the models of ``step-cost`` and ``precision`` (inputs 1×28×28, 10 classes)
STEP_MODELS: dict[str, Callable[[], nn.Module]] = {"mlp-784-512-512-10": mlp, "cnn": cnn}


def cnn32() -> nn.Module:
    """:func:`cnn` with 3 input channels, 32×32 inputs and ReLUs in place."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(inplace=True),
        nn.Linear(128, 10),
    )


class Block(nn.Module):
    """A pre-norm Transformer block with plain Linear projections."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        h = self.norm1(x)

        def split(z: Tensor) -> Tensor:
            return z.view(n, t, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(n, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    """A causal LM: embedding + learned positions, ``blocks`` :class:`Block`, norm, head."""

    def __init__(self, vocab: int, width: int, heads: int, blocks: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EncoderLM(LM):
    """The LM with ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention``)."""

    causal: Tensor  #: the causal mask (a buffer)

    def __init__(self, vocab: int, width: int, heads: int, blocks: int, context: int) -> None:
        super().__init__(vocab, width, heads, 0, context)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(blocks)
        )
        self.register_buffer(
            "causal", torch.ones(context, context).triu(1).bool(), persistent=False
        )

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.position[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(x))


#: a model's builder and its batches (drawn from a generator): ``(x, y)``
CompileModel = tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[Tensor, Tensor]]]


def compile_models(batch: int) -> dict[str, CompileModel]:
    """The models of ``compile-step``: :func:`cnn32` on random images, and three
    LMs on random characters (96 symbols, context 64)."""

    def images(g: torch.Generator) -> tuple[Tensor, Tensor]:
        x = torch.randn(batch, 3, 32, 32, generator=g)
        return x, torch.randint(0, 10, (batch,), generator=g)

    def text(g: torch.Generator) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, 96, (batch, 65), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return {
        "cnn": (cnn32, images),
        "lm-2x128": (lambda: LM(96, 128, 4, 2, 64), text),
        "lm-12x64": (lambda: LM(96, 64, 4, 12, 64), text),
        "mha-2x128": (lambda: EncoderLM(96, 128, 4, 2, 64), text),
    }


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy over every position (images: one per sample)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
