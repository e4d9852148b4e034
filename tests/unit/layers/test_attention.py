"""nn.MultiheadAttention's q, k, v and out projections against a dense float64
definition built from an independent re-implementation of attention."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.torch_support import COMPILE_FLOOR, release
from kfac_defaults import kfac_pytorch

from kfac_reference import dense_precondition, outer_mean, rel_err, with_ones

TOL = 1e-8
DAMPING = 0.01
E, H, N, L, S = 8, 2, 4, 5, 6


#: on kaisa's shipped defaults; the tests here mean kfac-pytorch's values (kfac_pytorch)
pytestmark = pytest.mark.usefixtures("float64_default")


def reference_attention(mha, query, key, value, attn_mask=None, key_padding_mask=None):
    """[N, L, E] output and the projections (q, k, v, ctx), batch first."""
    if not mha.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    q, k, v = query @ wq.t() + bq, key @ wk.t() + bk, value @ wv.t() + bv
    d = E // H

    def heads(t):
        return t.reshape(t.shape[0], t.shape[1], H, d).transpose(1, 2)

    scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(d)
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask, float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    ctx = (scores.softmax(-1) @ heads(v)).transpose(1, 2).reshape(q.shape[0], q.shape[1], E)
    out = ctx @ mha.out_proj.weight.t() + mha.out_proj.bias
    return out, {"q": (query, q), "k": (key, k), "v": (value, v), "out_proj": (ctx, out)}


class Model(nn.Module):
    def __init__(self, batch_first: bool, kdim: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=kdim)
        self.head = nn.Linear(E, 3)


CASES = {
    "self": dict(cross=False, kdim=None, masks=False, need_weights=False),
    "self-masks-weights": dict(cross=False, kdim=None, masks=True, need_weights=True),
    "cross": dict(cross=True, kdim=None, masks=True, need_weights=False),
    "cross-kdim": dict(cross=True, kdim=5, masks=False, need_weights=True),
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_projections_against_dense_definition(case: str, batch_first: bool) -> None:
    cfg = CASES[case]
    model = Model(batch_first, cfg["kdim"])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, L, E, generator=g)
    mem = torch.randn(N, S, cfg["kdim"] or E, generator=g) if cfg["cross"] else x
    y = torch.randint(0, 3, (N,), generator=g)
    masks = {}
    if cfg["masks"]:
        src = S if cfg["cross"] else L
        masks["attn_mask"] = torch.triu(torch.ones(L, src, dtype=torch.bool), diagonal=1 + src - L)
        kpm = torch.zeros(N, src, dtype=torch.bool)
        kpm[0, -1] = kpm[2, -2:] = True
        masks["key_padding_mask"] = kpm

    def layout(t):
        return t if batch_first else t.transpose(0, 1)

    def run(query, memory):
        out, _ = model.attn(
            layout(query), layout(memory), layout(memory), need_weights=cfg["need_weights"], **masks
        )
        return model.head(layout(out).mean(1))

    # the reference re-implementation is the module itself
    ref_out, _ = reference_attention(model.attn, layout(x), layout(mem), layout(mem), **masks)
    real_out, _ = model.attn(layout(x), layout(mem), layout(mem), need_weights=False, **masks)
    assert rel_err(ref_out, layout(real_out)) <= 1e-12

    precond = KFACPreconditioner(model, **kfac_pytorch(damping=DAMPING, kl_clip=None))
    assert sorted(precond.layers) == ["attn.k", "attn.out_proj", "attn.q", "attn.v", "head"]
    F.cross_entropy(run(x, mem), y).backward()
    raws = {n: precond._parts.engine.read(la.adapter).clone() for n, la in precond.layers.items()}
    precond.step()

    out, parts = reference_attention(model.attn, layout(x), layout(mem), layout(mem), **masks)
    losses = F.cross_entropy(model.head(out.mean(1)), y, reduction="none")
    outputs = [parts[k][1] for k in ("q", "k", "v", "out_proj")]
    grads = dict(zip(("q", "k", "v", "out_proj"), torch.autograd.grad(losses.sum(), outputs)))
    for role, (inputs, _) in parts.items():
        layer = precond.layers[f"attn.{role}"]
        A = outer_mean(with_ones(inputs.detach().reshape(-1, inputs.shape[-1])))
        rows = grads[role].reshape(-1, E)
        G = rows.t() @ rows / N
        assert rel_err(layer.factor("A"), A) <= TOL, role
        assert rel_err(layer.factor("G"), G) <= TOL, role
        got = precond._parts.engine.read(layer.adapter)
        assert rel_err(got, dense_precondition(raws[f"attn.{role}"], A, G, DAMPING)) <= TOL, role
    assert F.linear is torch._C._nn.linear  # the functional capture put F.linear back


def test_transformer_layers_fully_preconditioned() -> None:
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    dec = nn.TransformerDecoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = nn.ModuleDict({"enc": enc, "dec": dec})
    precond = KFACPreconditioner(model, **kfac_pytorch(damping=DAMPING))
    names = sorted(precond.layers)
    for prefix in ("enc.self_attn", "dec.self_attn", "dec.multihead_attn"):
        assert {f"{prefix}.{r}" for r in ("q", "k", "v", "out_proj")} <= set(names)
    src, tgt = torch.randn(N, L, E), torch.randn(N, S, E)
    mask = nn.Transformer.generate_square_subsequent_mask(S, dtype=torch.bool)
    out = dec(tgt, enc(src), tgt_mask=mask)
    out.pow(2).mean().backward()
    precond.step()
    assert all(la.captured for la in precond.layers.values())
    skipped = {s.name for s in precond.skipped}
    assert not any("attn" in s and "norm" not in s for s in skipped), skipped


@pytest.mark.parametrize("loss_average", ["batch", "batch_and_sequence"])
@pytest.mark.parametrize("method", ["eigen", "reduce"])
def test_sequence_first_transformer_layers_equal_batch_first(loss_average, method) -> None:
    """torch's transformer layers default to ``batch_first=False``: their
    feed-forward Linears see ``[T, N, d]``, and every factor must be the
    batch-first twin's (the batch sets G's multiplier and K-FAC-reduce's rows;
    T != N here, so reading T as the batch shows)."""
    factors = {}
    for batch_first in (True, False):
        torch.manual_seed(0)
        model = nn.ModuleDict(
            {
                "enc": nn.TransformerEncoderLayer(
                    E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first
                ),
                "dec": nn.TransformerDecoderLayer(
                    E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first
                ),
            }
        )
        options = kfac_pytorch(damping=DAMPING, loss_average=loss_average)
        if method == "reduce":
            options["kfac_approx"] = "reduce"
        precond = KFACPreconditioner(model, **options)
        g = torch.Generator().manual_seed(1)
        src, tgt = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
        if not batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        out = model["dec"](tgt, model["enc"](src))
        per_position = out.pow(2).sum(-1)
        (
            per_position.mean()
            if loss_average == "batch_and_sequence"
            else per_position.sum(int(batch_first)).mean()
        ).backward()
        precond.step()
        factors[batch_first] = {
            f"{n}.{s.name}": la.factor(s.name).clone()
            for n, la in precond.layers.items()
            for s in la.factors
        }
    assert factors[True].keys() == factors[False].keys()
    for key, value in factors[True].items():
        assert rel_err(factors[False][key], value) <= 1e-12, key


# -- activation checkpointing of a Transformer with attention and embeddings -------------
class TinyLM(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.emb = nn.Embedding(13, E)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        self.head = nn.Linear(E, 13)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.emb(idx)
        for block in self.blocks:
            if self.mode == "plain":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def _lm_run(mode: str, monkeypatch) -> tuple[dict, list[torch.Tensor], int]:
    import kaisa.step.capture.terms as terms

    calls = [0]
    original = terms.input_terms

    def counting(layer, x, memo=None, *rest):
        calls[0] += 1
        return original(layer, x, memo, *rest)

    monkeypatch.setattr(terms, "input_terms", counting)
    model = TinyLM(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, **kfac_pytorch(damping=DAMPING))
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        idx, y = (
            torch.randint(0, 13, (N, L), generator=g),
            torch.randint(0, 13, (N, L), generator=g),
        )
        opt.zero_grad()
        F.cross_entropy(model(idx).reshape(-1, 13), y.reshape(-1)).backward()
        precond.step()
        opt.step()
    factors = {
        f"{n}:{s.name}": la.factor(s.name).clone()
        for n, la in precond.layers.items()
        for s in la.factors
    }
    return factors, [p.detach().clone() for p in model.parameters()], calls[0]


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_checkpointed_transformer_equals_plain_and_hooks_work_once(mode: str, monkeypatch) -> None:
    want_factors, want_params, want_calls = _lm_run("plain", monkeypatch)
    got_factors, got_params, got_calls = _lm_run(mode, monkeypatch)
    assert {"emb:A", "blocks.0.self_attn.q:G", "blocks.1.self_attn.out_proj:A"} <= set(want_factors)
    if release() >= (2, 9):  # older torch shows the hooks no recomputation (work done twice)
        assert got_calls == want_calls  # no capture work is done twice
    for name, value in want_factors.items():
        assert rel_err(got_factors[name], value) <= 1e-10, name
    for a, b in zip(got_params, want_params):
        assert rel_err(a, b) <= 1e-10


def test_checkpoint_round_trip_with_attention_and_embeddings() -> None:
    """Diagonal (embedding) factors and the attention blocks travel through
    state_dict/load_state_dict: a resumed run equals the uninterrupted one."""

    def run(resume_at: int | None) -> list[torch.Tensor]:
        model = TinyLM("plain")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFACPreconditioner(
            model, optimizer=opt, **kfac_pytorch(damping=DAMPING, inv_update_steps=2)
        )
        g = torch.Generator().manual_seed(9)
        for step in range(4):
            if step == resume_at:
                state, opt_state = precond.state_dict(), opt.state_dict()
                params = [p.detach().clone() for p in model.parameters()]
                model = TinyLM("plain")
                with torch.no_grad():
                    for p, v in zip(model.parameters(), params):
                        p.copy_(v)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                opt.load_state_dict(opt_state)
                precond = KFACPreconditioner(
                    model, optimizer=opt, **kfac_pytorch(damping=DAMPING, inv_update_steps=2)
                )
                precond.load_state_dict(state)
                assert precond.layers["emb"].factor("A").shape == (13,)
            idx, y = (
                torch.randint(0, 13, (N, L), generator=g),
                torch.randint(0, 13, (N, L), generator=g),
            )
            opt.zero_grad()
            F.cross_entropy(model(idx).reshape(-1, 13), y.reshape(-1)).backward()
            precond.step()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    straight, resumed = run(None), run(2)
    for a, b in zip(resumed, straight):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")
def test_torch_compile_with_attention_captures_its_projections() -> None:
    """Under torch.compile the attention's own code is one opaque node, so
    kaisa's attention replaces its result: every projection is captured, and
    nothing is said (the compiled statistics equal eager capture's:
    tests/unit/step/test_compiled_attention.py)."""
    torch._dynamo.reset()
    model = Model(batch_first=True, kdim=None)
    precond = KFACPreconditioner(model, **kfac_pytorch(damping=DAMPING))

    def forward(x):
        return model.head(model.attn(x, x, x, need_weights=False)[0].mean(1))

    fn = torch.compile(forward, backend="eager")
    x, y = torch.randn(N, L, E), torch.randint(0, 3, (N,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(fn(x), y).backward()
        precond.step()
    assert not [w for w in caught if "kaisa" in str(w.message)], [str(w.message) for w in caught]
    assert all(precond.layers[f"attn.{r}"].captured for r in ("q", "k", "v", "out_proj"))
    assert F.linear is torch._C._nn.linear


def test_self_attention_forms_the_shared_input_factor_once(monkeypatch) -> None:
    """q, k and v of a packed self-attention read the same input: its factor
    term is formed once per call (then copied), and still equals each
    projection's own definition (the dense tests above)."""
    from kaisa.core.specs import FactorSource
    from kaisa.layers.base import LayerAdapter

    formed: list[str] = []
    original = LayerAdapter.factor_term

    def counting(self, spec, tensor, dtype, scale=1.0):
        if spec.source is FactorSource.INPUT:
            formed.append(self.name)
        return original(self, spec, tensor, dtype, scale)

    monkeypatch.setattr(LayerAdapter, "factor_term", counting)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double()
    precond = KFACPreconditioner(mha, **kfac_pytorch(damping=DAMPING))
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    out, _ = mha(x, x, x, need_weights=False)
    out.pow(2).mean().backward()
    assert len(formed) == 2, formed  # in_proj once (for q, k and v), out_proj once
    factors = {name: layer.batch.sums[0] for name, layer in precond.layers.items()}
    names = [n for n in factors if not n.endswith("out_proj")]
    assert len(names) == 3
    for name in names[1:]:  # equal, but not one tensor (sums are updated in place)
        assert torch.equal(factors[name], factors[names[0]])
        assert factors[name] is not factors[names[0]]


class _AttentionAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x)[0])


@pytest.mark.parametrize(
    ("pattern", "registered", "skipped"),
    [
        ("Linear", {"attn.q", "attn.k", "attn.v"}, {"attn.out_proj", "head"}),  # its class too
        ("NonDynamicallyQuantizableLinear", {"attn.q", "attn.k", "attn.v", "head"}, None),
        ("out_proj", {"attn.q", "attn.k", "attn.v", "head"}, {"attn.out_proj"}),
        ("MultiheadAttention", {"head"}, {"attn", "attn.out_proj"}),
    ],
)
def test_skip_layers_reaches_out_proj_by_name_or_class_and_tells_of_it_once(
    pattern: str, registered: set[str], skipped: set[str] | None
) -> None:
    """``out_proj`` is a module of its own: a pattern on its name or class name
    leaves its block to the optimizer (it was registered anyway when the
    class matched), and describe() lists it once, in one list."""
    torch.manual_seed(0)
    model = _AttentionAndHead()
    precond = KFACPreconditioner(model, skip_layers=[pattern], lr=0.1)
    assert set(precond.layers) == registered
    names = [s.name for s in precond.skipped]
    assert len(names) == len(set(names))  # each told of once
    assert set(names) == (skipped or {"attn.out_proj"})
    x = torch.randn(3, 4, 8)
    model(x).pow(2).mean().backward()
    raw = model.attn.out_proj.weight.grad.clone()
    precond.step()
    assert torch.equal(model.attn.out_proj.weight.grad, raw)  # left to the optimizer
