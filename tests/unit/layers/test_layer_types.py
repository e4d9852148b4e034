"""Conv1d and Hugging Face's Conv1D against dense float64 definitions."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from kfac_reference import (
    dense_precondition,
    dense_precondition_pi,
    grad_matrix,
    outer_mean,
    per_example_output_grads,
    rel_err,
    with_ones,
)

TOL = 1e-8
DAMPING = 0.01


#: on kaisa's shipped defaults; a test that means the exact solve asks for the eigen method
pytestmark = pytest.mark.usefixtures("float64_default")


def conv1d_patches(x: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """[N·L_out, C·k] by explicit slicing of an explicitly padded input."""
    (k,), (s,), (d,) = conv.kernel_size, conv.stride, conv.dilation
    if conv.padding == "same":
        total = d * (k - 1)
        pads = (total // 2, total - total // 2)
    elif conv.padding == "valid":
        pads = (0, 0)
    else:
        pads = (conv.padding[0], conv.padding[0])
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pads, mode=mode)
    span = d * (k - 1) + 1
    out = (xp.shape[-1] - span) // s + 1
    rows = [xp[:, :, i * s : i * s + span : d].reshape(x.shape[0], -1) for i in range(out)]
    return torch.stack(rows, dim=1).reshape(-1, x.shape[1] * k)


CONV1D_CASES = [
    dict(kernel_size=3, padding=1),
    dict(kernel_size=3, stride=2),
    dict(kernel_size=2, padding="same", dilation=2),
    dict(kernel_size=3, padding=2, padding_mode="reflect", dilation=2),
    dict(kernel_size=3, padding=1, padding_mode="circular", bias=False),
]


@pytest.mark.parametrize(
    "case", CONV1D_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_conv1d_against_explicit_patches(case: dict) -> None:
    torch.manual_seed(0)
    conv = nn.Conv1d(2, 3, **case)
    length = conv(torch.zeros(1, 2, 9)).shape[-1]
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(3 * length, 4))
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(5, 2, 9, generator=g), torch.randint(0, 4, (5,), generator=g)
    patches = conv1d_patches(x, conv)
    direct = patches @ conv.weight.reshape(3, -1).t() + (conv.bias if conv.bias is not None else 0)
    assert (
        rel_err(direct, conv(x).transpose(1, 2).reshape(-1, 3)) <= 1e-12
    )  # the reference is right

    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None, compute_method="eigen")
    F.cross_entropy(model(x), y).backward()
    raw = grad_matrix(conv).clone()
    precond.step()
    _, zg = per_example_output_grads(
        model, conv, x, lambda out: F.cross_entropy(out, y, reduction="none")
    )
    A = outer_mean(with_ones(patches) if conv.bias is not None else patches)
    g_rows = zg.transpose(1, 2).reshape(-1, 3)
    G = g_rows.t() @ g_rows / 5
    layer = precond.layers["0"]
    assert rel_err(layer.factor("A"), A) <= TOL
    assert rel_err(layer.factor("G"), G) <= TOL
    assert rel_err(grad_matrix(conv), dense_precondition(raw, A, G, DAMPING)) <= TOL


def test_hf_conv1d_transposed_linear() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    layer = Conv1D(4, 3)  # nf=4 outputs, nx=3 inputs: weight [3, 4]
    model = nn.Sequential(layer, nn.Tanh(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, 3, generator=g), torch.randint(0, 2, (6, 5), generator=g)

    def per_example(out: torch.Tensor) -> torch.Tensor:
        return (
            F.cross_entropy(out.reshape(-1, 2), y.reshape(-1), reduction="none").view(6, 5).sum(1)
        )

    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None, compute_method="eigen")
    assert "0" in precond.layers and transformers is not None
    per_example(model(x)).mean().backward()
    raw = torch.cat([layer.weight.grad.t(), layer.bias.grad[:, None]], dim=1).clone()
    precond.step()
    inp, zg = per_example_output_grads(model, layer, x, per_example)
    A = outer_mean(with_ones(inp.reshape(-1, 3)))
    rows = zg.reshape(-1, 4)
    G = rows.t() @ rows / 6
    k = precond.layers["0"]
    assert rel_err(k.factor("A"), A) <= TOL and rel_err(k.factor("G"), G) <= TOL
    got = torch.cat([layer.weight.grad.t(), layer.bias.grad[:, None]], dim=1)
    assert rel_err(got, dense_precondition(raw, A, G, DAMPING)) <= TOL


# -- nn.Embedding: diagonal A (token frequencies), dense G -------------------------------
class Bag(nn.Module):
    def __init__(self, vocab: int, dim: int, padding_idx: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)).mean(1))


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_embedding_diagonal_factor_against_dense_definition(padding_idx, method: str) -> None:
    vocab, dim = 9, 4
    model = Bag(vocab, dim, padding_idx)
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, vocab - 2, (6, 5), generator=g)  # the last two tokens never occur
    y = torch.randint(0, 3, (6,), generator=g)
    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None, compute_method=method)
    F.cross_entropy(model(idx), y).backward()
    raw = model.emb.weight.grad.t().clone()  # canonical [dim, vocab]
    precond.step()
    layer = precond.layers["emb"]
    onehot = F.one_hot(idx.reshape(-1), vocab).double()
    if padding_idx is not None:
        onehot[:, padding_idx] = 0
    A_dense = outer_mean(onehot)  # the one-hot Gram is diagonal
    assert torch.count_nonzero(A_dense - torch.diag(A_dense.diagonal())) == 0
    assert layer.factor("A").shape == (vocab,)
    assert rel_err(layer.factor("A"), A_dense.diagonal()) <= TOL
    _, zg = per_example_output_grads(
        model, model.emb, idx, lambda out: F.cross_entropy(out, y, reduction="none")
    )
    rows = zg.reshape(-1, dim)
    G = rows.t() @ rows / 6
    assert rel_err(layer.factor("G"), G) <= TOL
    if method == "eigen":
        want = dense_precondition(raw, A_dense, G, DAMPING)
    else:
        want = dense_precondition_pi(raw, A_dense, G, DAMPING)
    assert rel_err(model.emb.weight.grad.t(), want) <= TOL
    if padding_idx is not None:
        assert torch.count_nonzero(model.emb.weight.grad[padding_idx]) == 0


def test_embedding_factor_memory_is_linear_in_vocabulary() -> None:
    vocab, dim = 50_000, 8
    model = nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, 2))
    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None)
    model(torch.randint(0, vocab, (4, 3))).sum().backward()
    precond.step()
    factors = precond.memory_usage()["factors"]
    itemsize = torch.empty((), dtype=precond.layers["0"].factor_dtype).element_size()
    # A: vocab entries, G: dim², the Linear: (dim+1)² + 2²; nothing vocab²-sized
    assert factors == itemsize * (vocab + dim * dim + (dim + 1) ** 2 + 4)
    assert precond.memory_usage()["total"] < 10 * itemsize * vocab * (dim + 2)


def test_sparse_embedding_is_refused_with_a_reason() -> None:
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="sparse=True"):
        precond = KFACPreconditioner(model)
    (skipped,) = [s for s in precond.skipped if s.name == "0"]
    assert "sparse=True" in skipped.reason and "skip_layers" in skipped.reason


def _parametrized(how: str) -> nn.Module:
    from torch.nn.utils import parametrizations, prune

    layer = nn.Linear(5, 5)
    if how == "prune":
        prune.l1_unstructured(layer, "weight", amount=0.4)
        return layer
    if how == "bias":
        from torch.nn.utils import parametrize

        class Halved(nn.Module):
            def forward(self, b: torch.Tensor) -> torch.Tensor:
                return b / 2

        parametrize.register_parametrization(layer, "bias", Halved())
        return layer
    return getattr(parametrizations, how)(layer)


@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm", "orthogonal", "prune", "bias"])
def test_a_weight_computed_from_other_parameters_is_left_to_the_optimizer(how: str) -> None:
    """A parametrized or pruned weight is a tensor computed on each access:
    its gradient is never kept (the registered layer was never preconditioned,
    and its step raised a KeyError on the tensor's changing identity).  It is
    told of with the reason, and the other layers train as before."""
    torch.manual_seed(0)
    model = nn.Sequential(_parametrized(how), nn.Tanh(), nn.Linear(5, 2))
    twin = nn.Sequential(nn.Identity(), nn.Identity(), nn.Linear(5, 2))
    twin[2].load_state_dict(model[2].state_dict())
    with pytest.warns(UserWarning, match="computed from other parameters"):
        precond = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    reference = KFACPreconditioner(twin, factor_update_steps=1, inv_update_steps=1)
    assert sorted(precond.layers) == ["2"]
    (skipped,) = [s for s in precond.skipped if s.name == "0"]
    assert "weight_norm" in skipped.reason
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        model.zero_grad()
        twin.zero_grad()
        hidden = model[1](model[0](x))  # once: spectral_norm iterates per forward
        model[2](hidden).pow(2).mean().backward()
        twin[2](hidden.detach()).pow(2).mean().backward()
        precond.step()
        reference.step()
        assert torch.equal(model[2].weight.grad, twin[2].weight.grad)


# -- tied input/output embeddings ---------------------------------------------------------
class TiedLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def test_tied_head_uses_head_factors_with_diagonal_g() -> None:
    """The definition: the summed (embedding + head) gradient of the tied weight,
    preconditioned by (diag(G_head) ⊗ A_head + γI)⁻¹ with A_head = E[h hᵀ] over the
    head's inputs and G_head,v = 1/N Σ ĝ_v² over its output gradients."""
    vocab, dim = 11, 4
    model = TiedLM(vocab, dim)
    g = torch.Generator().manual_seed(6)
    idx, y = (
        torch.randint(0, vocab, (5, 3), generator=g),
        torch.randint(0, vocab, (5, 3), generator=g),
    )

    def per_example(out: torch.Tensor) -> torch.Tensor:
        return (
            F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1), reduction="none")
            .view(5, 3)
            .sum(1)
        )

    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None, compute_method="eigen")
    assert "emb" not in precond.layers and precond.layers["head"].factor("G") is None
    per_example(model(idx)).mean().backward()
    raw = model.head.weight.grad.clone()  # embedding's and head's contributions summed
    precond.step()
    layer = precond.layers["head"]
    inp, zg = per_example_output_grads(model, model.head, idx, per_example)
    A = outer_mean(inp.reshape(-1, dim))
    rows = zg.reshape(-1, vocab)
    G_diag = (rows * rows).sum(0) / 5
    assert layer.factor("G").shape == (vocab,)
    assert rel_err(layer.factor("A"), A) <= TOL and rel_err(layer.factor("G"), G_diag) <= TOL
    want = dense_precondition(raw, A, torch.diag(G_diag), DAMPING)
    assert rel_err(model.head.weight.grad, want) <= TOL
    assert "tied to emb.weight" in precond.describe()


def test_position_ids_broadcast_over_the_batch_are_seen_through_or_reported() -> None:
    """Ids [1, T] whose embedding the model adds to the batch: captured per
    example where the broadcast happens (kaisa.step.capture.broadcast; test_broadcast.py),
    so the factors equal those of per-example ids and nothing is reported.
    A use kaisa cannot see through (the model's own expand) is reported."""

    class Positional(nn.Module):
        def __init__(self, mode: str) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.mode = mode
            self.tok, self.pos, self.head = nn.Embedding(9, 4), nn.Embedding(5, 4), nn.Linear(4, 2)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(idx.shape[1])[None]
            if self.mode == "per-example":
                positions = positions.expand(idx.shape[0], -1)
            p = self.pos(positions)
            tokens = self.tok(idx)
            return self.head(tokens + (p.expand_as(tokens) if self.mode == "own-expand" else p))

    idx = torch.randint(0, 9, (6, 5))
    found = {}
    for mode in ("broadcast", "per-example", "own-expand"):
        model = Positional(mode)
        precond = KFACPreconditioner(model)
        model(idx).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        messages = [str(w.message) for w in caught if "broadcast" in str(w.message)]
        found[mode] = precond.layers["pos"].factor("G")
        if mode == "own-expand":
            assert len(messages) == 1 and "'pos'" in messages[0] and "expand" in messages[0]
        else:
            assert not messages
    assert rel_err(found["broadcast"], found["per-example"]) <= TOL
