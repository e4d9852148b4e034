"""Hugging Face GPT-2 and BERT built from a config (no download): every
linear-like layer is preconditioned except what describe() explains, the tied
LM head is handled, and a few training steps lower the loss; a stock GPT-2
(position ids [1, T], broadcast over the batch) trains with no kaisa warning
and its position embedding's factors equal their definition."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from kaisa import KFACPreconditioner  # noqa: E402

VOCAB, LENGTH, BATCH = 64, 12, 8


def tokens(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a learnable pattern: each sequence counts up from a random start
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    return (start + torch.arange(LENGTH)) % VOCAB


def train(
    model: torch.nn.Module, precond: KFACPreconditioner, batch: dict, steps: int = 8
) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        precond.step()
        optimizer.step()
        losses.append(loss.item())
    return losses


def linear_like(model: torch.nn.Module) -> set[str]:
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    return {n for n, m in model.named_modules() if isinstance(m, kinds)}


def test_gpt2_from_config() -> None:
    model = small_gpt2()
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=0.01, loss_average="items")
    ids = tokens()
    precond.loss_items = BATCH * (LENGTH - 1)  # the loss averages the shifted targets
    # per-example position ids here; the stock [1, T] row broadcast over the
    # batch is captured per example too (test_stock_gpt2_* below)
    positions = torch.arange(LENGTH).expand(BATCH, LENGTH)
    batch = {"input_ids": ids, "labels": ids, "position_ids": positions}
    skipped = {s.name: s.reason for s in precond.skipped}
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "tied to transformer.wte.weight" in precond.describe()
    assert "lm_head" in skipped.get("transformer.wte", "") or "lm_head" in precond.describe()
    assert linear_like(model) - {"transformer.wte"} <= set(precond.layers)
    for name in skipped:  # all that is left out is explained
        assert name in precond.describe()
    losses = train(model, precond, batch)
    assert losses[-1] < 0.95 * losses[0] and all(b < a for a, b in itertools.pairwise(losses)), (
        losses
    )


def test_bert_masked_lm_from_config() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForMaskedLM(config)
    ids = tokens(1)
    labels = torch.full_like(ids, -100)
    masked = torch.zeros_like(ids, dtype=torch.bool)
    masked[:, 2::3] = True
    labels[masked] = ids[masked]
    inputs = ids.masked_fill(masked, 0)
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=0.01, loss_average="items")
    precond.loss_items = int(masked.sum())
    positions = torch.arange(LENGTH).expand(BATCH, LENGTH)
    batch = {"input_ids": inputs, "labels": labels, "position_ids": positions}
    word = "bert.embeddings.word_embeddings"
    assert model.cls.predictions.decoder.weight is model.get_input_embeddings().weight
    assert f"tied to {word}.weight" in precond.describe()
    assert linear_like(model) - {word} <= set(precond.layers)
    assert {"bert.encoder.layer.0.attention.self.query", "cls.predictions.decoder"} <= set(
        precond.layers
    )
    losses = train(model, precond, batch)
    assert losses[-1] < 0.95 * losses[0] and all(b < a for a, b in itertools.pairwise(losses)), (
        losses
    )


def small_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def test_stock_gpt2_trains_without_a_kaisa_warning() -> None:
    """No position_ids: GPT-2 builds them as [1, T] and broadcasts the
    position embedding over the batch; kaisa takes its per-example gradients
    where the broadcast happens (kaisa.step.capture.broadcast), so there is nothing to warn about."""
    model = small_gpt2()
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=0.01, loss_average="items")
    precond.loss_items = BATCH * (LENGTH - 1)
    ids = tokens()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kaisa")
        losses = train(model, precond, {"input_ids": ids, "labels": ids})
    assert "transformer.wpe" in precond.layers
    assert losses[-1] < 0.95 * losses[0] and all(b < a for a, b in itertools.pairwise(losses)), (
        losses
    )


def test_stock_gpt2_position_embedding_factors_equal_their_definition() -> None:
    """A and G of transformer.wpe, float64, against the definition: A counts
    one row per (example, position), over N·T rows; G sums the per-example
    gradients of the hidden state the position embedding is added to,
    ``∂L/∂h[n, t]`` (taken as ``∂L/∂inputs_embeds``, since
    ``h = inputs_embeds + wpe(positions)``), scaled by ``m = N·(T−1)`` (the
    loss averages the shifted targets), over positions and divides by the N
    examples (kaisa's G counts data points)."""
    model = small_gpt2().double()
    reference = copy.deepcopy(model)  # its hooks are inert
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=None, loss_average="items")
    items = BATCH * (LENGTH - 1)
    precond.loss_items = items
    ids = tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    precond.step()
    layer = precond.layers["transformer.wpe"]

    embeds = reference.transformer.wte(ids).detach().requires_grad_()
    loss = reference(inputs_embeds=embeds, labels=ids).loss
    (g,) = torch.autograd.grad(loss, embeds)
    rows = (items * g).reshape(-1, g.shape[-1])  # [N·T, d]
    want_g = rows.T @ rows / BATCH
    want_a = torch.full(
        (LENGTH,), 1.0 / LENGTH, dtype=torch.float64
    )  # each position N times in N·T
    got_a, got_g = layer.factor("A"), layer.factor("G")
    assert float((got_a - want_a).norm() / want_a.norm()) <= 1e-12
    assert float((got_g - want_g).norm() / want_g.norm()) <= 1e-10
