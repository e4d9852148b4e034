"""Capture inside ``torch.compile`` (kaisa.step.capture.graph).

1. **No graph breaks**: a compiled forward with kaisa attached runs as many
   graphs as the plain model's (one), on factor steps and on non-factor
   steps, for every module-hook layer type; dynamo records no break.  The
   two steps are two compiled variants, compiled once each.
2. **The same statistics**: compiled + kaisa equals eager + kaisa (factors
   and parameters after several factor and inverse updates), with
   micro-batches, a layer called twice per pass, a summed or item-averaged
   loss, a grad scaler's loss scale and EKFAC's joint statistic.
3. **A fraction of the positions**: with ``factor_position_fraction`` the
   compiled forward reads each factor step's draw as a graph input: the
   same two variants serve every factor step, and the statistics equal
   eager's step after step (a draw frozen into the graph would not).
4. **Only training gradients count**: an input gradient taken with
   ``torch.autograd.grad`` through a compiled forward adds nothing.

The backend is ``aot_eager``: AOTAutograd traces the forward and the
backward (the capture's backward included) as inductor would, without its
code generation; one test runs inductor itself (slow).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from compiled_case import Counting, assert_close, loss_of
from kaisa import KFACPreconditioner
from kaisa.torch_support import COMPILE_FLOOR

pytestmark = pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")

KW: dict[str, Any] = dict(factor_update_steps=2, inv_update_steps=4, damping=0.1, lr=0.1)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles from scratch: models of one class share a frame
    (``Sequential.forward``), whose recompilations across tests would reach
    dynamo's limit and fall back to eager."""
    torch._dynamo.reset()


class LM(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=0)
        self.fc = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.fc(self.emb(x))))


class Shared(nn.Module):
    """One Linear called twice per pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )


def conv1d() -> nn.Module:
    return nn.Sequential(nn.Conv1d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 5, 3))


def hf_conv1d() -> nn.Module:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    return nn.Sequential(pytorch_utils.Conv1D(8, 6), nn.Tanh(), nn.Linear(8, 3))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Tensor]]] = {
    "mlp": (mlp, lambda g: torch.randn(5, 6, generator=g)),
    "cnn": (cnn, lambda g: torch.randn(5, 3, 6, 6, generator=g)),
    "conv1d": (conv1d, lambda g: torch.randn(5, 3, 7, generator=g)),
    "embedding": (LM, lambda g: torch.randint(0, 11, (5, 4), generator=g)),
    "hf_conv1d": (hf_conv1d, lambda g: torch.randn(5, 6, generator=g)),
    "shared": (Shared, lambda g: torch.randn(5, 6, generator=g)),
    # wide and tall enough for the CPU's blocked Gram (kaisa.core.statistics.gram)
    "wide": (lambda: nn.Linear(8, 256), lambda g: torch.randn(2, 260, 8, generator=g)),
}


def train(
    model: nn.Module,
    forward: Callable[[Tensor], Tensor],
    make_input: Callable[[torch.Generator], Tensor],
    steps: int,
    micro: int = 1,
    loss: Callable[[Tensor], Tensor] = loss_of,
    items: float | None = None,
    **kw: Any,
) -> KFACPreconditioner:
    precond = KFACPreconditioner(model, **{**KW, "accumulation_steps": micro, **kw})
    precond.loss_items = items
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            (loss(forward(make_input(g))) / micro).backward()
        precond.step()
        opt.step()
    return precond


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_forward_is_one_graph_on_factor_and_other_steps(name: str) -> None:
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    model = build()
    plain = Counting()
    compiled_plain = torch.compile(copy.deepcopy(model), backend=plain)
    g = torch.Generator().manual_seed(0)
    loss_of(compiled_plain(make_input(g))).backward()
    assert plain.runs == 1  # the plain model is one graph

    counters.clear()
    backend = Counting()
    compiled = torch.compile(model, backend=backend)
    train(model, compiled, make_input, steps=4)  # factor, other, factor, other
    assert backend.runs == 4, f"{backend.runs} graph runs for 4 forwards"
    assert backend.compiled == 2  # the factor-step and the other variant, once each
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_statistics_equal_eager(name: str) -> None:
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    eager = build()
    model = copy.deepcopy(eager)
    want = train(eager, eager, make_input, steps=5)
    got = train(model, torch.compile(model, backend="aot_eager"), make_input, steps=5)
    assert_close(got, want)


#: the models whose layers see several positions per data point
SEQUENCES = ("cnn", "conv1d", "embedding", "shared_sequence", "wide")
MODELS["shared_sequence"] = (Shared, lambda g: torch.randn(5, 9, 6, generator=g))


@pytest.mark.parametrize("name", SEQUENCES)
def test_a_fraction_of_the_positions_compiles_once_and_equals_eager(name: str) -> None:
    """Four factor steps, four draws (factors every second step of eight),
    micro-batches on one: every step's statistics equal eager's, from the
    two compiled variants and no graph break."""
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    eager = build()
    model = copy.deepcopy(eager)
    options: dict[str, Any] = dict(factor_position_fraction=0.3, factor_position_seed=3)
    micro = 2 if name == "shared_sequence" else 1
    want = train(eager, eager, make_input, steps=8, micro=micro, **options)
    counters.clear()
    backend = Counting()
    got = train(model, torch.compile(model, backend=backend), make_input, 8, micro, **options)
    assert backend.compiled == 2, f"{backend.compiled} graphs compiled over 4 draws"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_close(got, want)


def test_sequences_of_every_length_share_one_graph_with_their_own_draws() -> None:
    """Lengths that change from step to step: dynamo compiles the length as
    a symbol after the first change, and each length's draw (its count
    ⌈f·T⌉ and its positions) is formed in that one graph as eager forms it."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model = copy.deepcopy(eager)
    lengths = iter([8, 12, 16, 9, 8, 13] * 2)

    def make_input(g: torch.Generator) -> Tensor:
        return torch.randn(4, next(lengths), 5, generator=g)

    options: dict[str, Any] = dict(factor_update_steps=1, factor_position_fraction=0.3)
    want = train(eager, eager, make_input, steps=6, **options)
    counters.clear()
    backend = Counting()
    got = train(model, torch.compile(model, backend=backend), make_input, 6, **options)
    assert backend.compiled == 2, f"{backend.compiled} graphs for 5 lengths"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_close(got, want)


@pytest.mark.parametrize(
    ("name", "fraction"),
    [(name, None) for name in sorted(MODELS)] + [(name, 0.3) for name in SEQUENCES],
)
def test_a_model_compiled_dynamic_from_the_start_equals_eager(
    name: str, fraction: float | None
) -> None:
    """``torch.compile(dynamic=True)``: every size and every float dynamo
    reads from an object is a symbol from the first trace; none may reach the
    capture's backward as one (dynamo cannot lift it there), so the loss's
    multiplier, the scales and the positions' count are formed from the
    sizes' symbols or as literals.  Each variant compiles as the plain model
    does (an Embedding's float ``norm_type`` makes dynamo compile it twice),
    and the statistics are eager's."""
    build, make_input = MODELS[name]
    torch.manual_seed(0)
    eager = build()
    model = copy.deepcopy(eager)
    plain = Counting()
    compiled_plain = torch.compile(copy.deepcopy(model), backend=plain, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        loss_of(compiled_plain(make_input(g))).backward()
    options: dict[str, Any] = dict(factor_position_fraction=fraction)
    want = train(eager, eager, make_input, steps=5, **options)
    torch._dynamo.reset()
    counters.clear()
    backend = Counting()
    got = train(
        model, torch.compile(model, backend=backend, dynamic=True), make_input, 5, **options
    )
    assert backend.compiled == 2 * plain.compiled
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_close(got, want)


def test_micro_batches_summed_loss_and_items_equal_eager() -> None:
    make_input = MODELS["shared"][1]
    for micro, average in ((3, "batch"), (2, "sum"), (2, "items")):
        torch.manual_seed(0)
        eager = Shared()
        model = copy.deepcopy(eager)
        kw: dict[str, Any] = dict(micro=micro, loss_average=average)
        if average != "batch":  # summed, or divided by N items set per step (read at step())
            n = 1.0 if average == "sum" else 7.0
            kw["loss"] = lambda out, n=n: out.logsumexp(-1).sum() / n
            kw["items"] = None if average == "sum" else n
        want = train(eager, eager, make_input, steps=4, **kw)
        got = train(model, torch.compile(model, backend="aot_eager"), make_input, steps=4, **kw)
        assert_close(got, want)


def test_grad_scaler_scale_is_divided_out() -> None:
    make_input = MODELS["mlp"][1]
    torch.manual_seed(0)
    eager = mlp()
    model = copy.deepcopy(eager)

    def run(net: nn.Module, forward: Callable[[Tensor], Tensor]) -> KFACPreconditioner:
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        precond = KFACPreconditioner(net, grad_scaler=scaler, **KW)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            scaler.scale(loss_of(forward(make_input(g)))).backward()
            scaler.unscale_(opt)
            precond.step()
            scaler.step(opt)
            scaler.update()
        return precond

    assert_close(run(model, torch.compile(model, backend="aot_eager")), run(eager, eager))


def test_ekfac_joint_statistic_under_compile_equals_eager() -> None:
    make_input = MODELS["mlp"][1]
    torch.manual_seed(0)
    eager = mlp()
    model = copy.deepcopy(eager)
    # S is folded between inverse updates (factor steps 1, 2 after each restart)
    kw = dict(compute_method="ekfac", factor_update_steps=1, inv_update_steps=3)
    want = train(eager, eager, make_input, steps=5, **kw)
    got = train(model, torch.compile(model, backend="aot_eager"), make_input, steps=5, **kw)
    assert_close(got, want)
    for name, la in got.layers.items():
        for key, value in la.state.items():
            ref = want.layers[name].state[key]
            assert float((value - ref).norm() / ref.norm().clamp_min(1e-30)) <= 1e-5, key


def test_an_input_gradient_through_a_compiled_forward_adds_nothing() -> None:
    torch.manual_seed(0)
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(5, 6, requires_grad=True)
    torch.autograd.grad(loss_of(compiled(x)), x)
    assert not precond._parts.capture.graph.has_data()
    loss_of(compiled(torch.randn(5, 6))).backward()
    assert precond._parts.capture.graph.has_data()


@pytest.mark.slow
def test_inductor_compiled_training_equals_eager() -> None:
    make_input = MODELS["cnn"][1]
    torch.manual_seed(0)
    eager = cnn()
    model = copy.deepcopy(eager)
    want = train(eager, eager, make_input, steps=5)
    backend = Counting("inductor")
    got = train(model, torch.compile(model, backend=backend), make_input, steps=5)
    assert backend.compiled == 2 and backend.runs == 5
    assert_close(got, want, 1e-4)


def test_a_model_compiled_and_run_before_kaisa_is_reported() -> None:
    """dynamo does not guard on module hooks: code compiled before kaisa's
    hooks existed keeps running without them, and step() says why."""
    torch.manual_seed(0)
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")
    loss_of(compiled(torch.randn(5, 6))).backward()
    precond = KFACPreconditioner(model, **KW)
    model.zero_grad()
    loss_of(compiled(torch.randn(5, 6))).backward()
    with pytest.warns(UserWarning, match="compiled and run before KFACPreconditioner was built"):
        precond.step()
    assert not any(la.captured for la in precond.layers.values())


def test_sinks_follow_a_model_moved_after_the_preconditioner_was_built() -> None:
    """Sinks on another device than the layer's (the model moved after kaisa
    was built): that compiled call is not captured — no failure in backward
    — and the next factor step's collection puts new sinks on the layer's device."""
    from kaisa.step.capture.graph import _Sinks

    make_input = MODELS["mlp"][1]
    torch.manual_seed(0)
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    graph = precond._parts.capture.graph
    first = precond.layers["0"]
    graph._sinks["0"] = _Sinks(first, torch.device("meta"))  # as if built elsewhere
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    loss_of(compiled(make_input(g))).backward()
    with pytest.warns(UserWarning, match="'0' has a gradient but its hooks never captured"):
        precond.step()  # step 0: '0' uncaptured, its sinks moved
    assert not first.captured and precond.layers["2"].captured
    assert graph._sinks["0"].device == torch.device("cpu")
    for _ in range(2):  # steps 1 and 2 (a factor step): captured now
        model.zero_grad()
        loss_of(compiled(make_input(g))).backward()
        precond.step()
    assert first.captured
