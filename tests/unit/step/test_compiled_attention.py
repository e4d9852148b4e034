"""``nn.MultiheadAttention`` under ``torch.compile`` (kaisa.step.capture.attention_graph).

1. **kaisa's attention is the module's**: :func:`attention_forward` returns
   the module's output and weights (float64, every option: packed or separate
   projections, self- and cross-attention, batch-first or not, unbatched,
   masks of both kinds and the causal hint, bias_k/bias_v, add_zero_attn,
   per-head or averaged weights).
2. **The same statistics**: a compiled model's q, k, v and out blocks equal
   eager capture's (factors and parameters after factor and inverse updates),
   from every position or from a fraction of them.
3. **No graph breaks**: a compiled Transformer of ``nn.TransformerEncoderLayer``
   runs one graph per forward with kaisa attached, its attention captured.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters

from compiled_case import Counting, assert_close, loss_of
from kaisa import KFACPreconditioner
from kaisa.step.capture.attention_graph import attention_forward, forward_arguments
from kaisa.torch_support import COMPILE_FLOOR

NEEDS_COMPILE = pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def _plain(parts: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.linear(x, weight, bias)


# (module keywords, call builder: (generator) -> args, kwargs)
E, H, L, S, N = 8, 2, 5, 6, 3


def _x(g: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _causal(n: int) -> Tensor:
    return torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)


CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "self-batch-first-causal-hint": (
        dict(batch_first=True),
        lambda g: (
            (x := _x(g, N, L, E), x, x),
            dict(attn_mask=_causal(L), is_causal=True, need_weights=False),
        ),
    ),
    "self-seq-first-padding-weights": (
        dict(),
        lambda g: (
            (x := _x(g, L, N, E), x, x),
            dict(key_padding_mask=torch.tensor([[False] * L, [False] * 3 + [True] * 2] * 2)[:N]),
        ),
    ),
    "per-head-weights-float-mask": (
        dict(batch_first=True, bias=False),
        lambda g: (
            (x := _x(g, N, L, E), x, x),
            dict(attn_mask=_x(g, N * H, L, L), average_attn_weights=False),
        ),
    ),
    "cross-kv-shared": (
        dict(batch_first=True),
        lambda g: ((_x(g, N, L, E), (kv := _x(g, N, S, E)), kv), dict(need_weights=False)),
    ),
    "cross-kdim-vdim-bias-kv-zero-attn": (
        dict(batch_first=True, kdim=4, vdim=6, add_bias_kv=True, add_zero_attn=True),
        lambda g: (
            (_x(g, N, L, E), _x(g, N, S, 4), _x(g, N, S, 6)),
            dict(key_padding_mask=torch.rand(N, S, generator=g) > 0.7),
        ),
    ),
    "unbatched-bool-mask": (
        dict(add_bias_kv=True),
        lambda g: ((x := _x(g, L, E), x, x), dict(attn_mask=_causal(L))),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kaisas_attention_is_the_modules(case: str) -> None:
    options, call = CASES[case]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, **options).double()
    if mha.bias_k is not None:
        nn.init.normal_(mha.bias_k)
        nn.init.normal_(mha.bias_v)
    args, kwargs = call(torch.Generator().manual_seed(0))
    want = mha(*args, **kwargs)
    got = attention_forward(mha, {}, _plain, forward_arguments(args, kwargs))
    torch.testing.assert_close(got[0], want[0])
    if want[1] is None:
        assert got[1] is None
    else:
        assert got[1] is not None
        torch.testing.assert_close(got[1], want[1])


class Attend(nn.Module):
    """An attention module between two Linears (a cross-attention when ``memory``)."""

    def __init__(self, memory: bool, **options: Any) -> None:
        super().__init__()
        self.inp = nn.Linear(6, E)
        self.mem = nn.Linear(6, options.get("kdim", E)) if memory else None
        self.attn = nn.MultiheadAttention(E, H, batch_first=True, **options)
        self.head = nn.Linear(E, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        if self.mem is not None:
            m = self.mem(x.flip(1))
            out, _ = self.attn(h, m, m, need_weights=False)
        else:
            out, _ = self.attn(h, h, h, attn_mask=_causal(x.shape[1]), is_causal=True)
        return self.head(torch.relu(out + h))


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(E, H, 16, dropout=0.0, batch_first=True, norm_first=True)
    return nn.Sequential(
        nn.Linear(6, E), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    )


MODELS = {
    "self": lambda: Attend(False),
    "cross-bias-kv": lambda: Attend(True, add_bias_kv=True),
    "cross-kdim": lambda: Attend(True, kdim=5, vdim=5),
    "encoder": encoder,
}
KW: dict[str, Any] = dict(factor_update_steps=2, inv_update_steps=4, damping=0.1, lr=0.1)


def _train(model: nn.Module, forward: Any, steps: int, **options: Any) -> KFACPreconditioner:
    precond = KFACPreconditioner(model, **KW, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        loss_of(forward(torch.randn(N, L, 6, generator=g))).backward()
        precond.step()
        opt.step()
    return precond


@NEEDS_COMPILE
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_attention_statistics_equal_eager(name: str) -> None:
    torch.manual_seed(0)
    eager = MODELS[name]()
    model = copy.deepcopy(eager)
    want = _train(eager, eager, steps=5)
    got = _train(model, torch.compile(model, backend="aot_eager"), steps=5)
    attention = [n for n in got.layers if n.endswith((".q", ".k", ".v", "out_proj"))]
    assert len(attention) >= 4, list(got.layers)
    assert_close(got, want)


@pytest.mark.parametrize(
    ("name", "dynamic"),
    [
        ("self", None),
        ("encoder", None),
        # every size a symbol: dynamo's shape reasoning over the encoder takes ~40 s
        pytest.param("encoder", True, marks=pytest.mark.slow),
    ],
)
@NEEDS_COMPILE
def test_compiled_attention_from_a_fraction_of_the_positions_equals_eager(
    name: str, dynamic: bool | None
) -> None:
    """Each factor step's draw reaches the compiled projections (q, k and v
    share one A term, as in eager capture); compiled with every size
    symbolic from the start too (``dynamic=True``)."""
    torch.manual_seed(0)
    eager = MODELS[name]()
    model = copy.deepcopy(eager)
    want = _train(eager, eager, steps=7, factor_position_fraction=0.4)
    compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic)
    got = _train(model, compiled, 7, factor_position_fraction=0.4)
    assert_close(got, want)


@NEEDS_COMPILE
@pytest.mark.parametrize("fraction", [None, 0.4])
def test_compiled_transformer_encoder_is_one_graph_with_attention_captured(
    fraction: float | None,
) -> None:
    torch.manual_seed(0)
    model = encoder()
    counters.clear()
    backend = Counting()
    compiled = torch.compile(model, backend=backend)
    # factor, other, factor, other, ...: a fresh draw at each factor step
    steps = 4 if fraction is None else 6
    precond = _train(model, compiled, steps, factor_position_fraction=fraction)
    assert backend.runs == steps and backend.compiled == 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(layer.captured for layer in precond.layers.values())
