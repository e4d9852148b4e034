"""A position embedding called on one row of ids ``[1, T]`` and broadcast
over the batch (kaisa.step.capture.broadcast): its factors equal those of the same model
fed per-example ids ``[N, T]`` — the per-example output gradients, taken
where the broadcast happens — for every way a model may combine it, with no
warning; a use kaisa cannot see through keeps the batch-summed gradient and
the warning that says so."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

V, T, D, N = 11, 5, 4, 6


class PositionModel(nn.Module):
    def __init__(self, how: str, per_example: bool = False, flat: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.head = nn.Linear(D, V)
        self.how = how
        self.per_example = per_example
        self.flat = flat  # ids [T] (nanoGPT's wpe(arange(T))), not [1, T]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(T) if self.flat else torch.arange(T).unsqueeze(0)
        if self.per_example:
            positions = positions.expand(ids.shape[0], T)
        h, p = self.tok(ids), self.pos(positions)
        if self.how == "add":
            h = h + p
        elif self.how == "radd":
            h = p + h
        elif self.how == "iadd":
            h = h.clone()
            h += p
        elif self.how == "torch.add":
            h = torch.add(h, p, alpha=1)
        elif self.how == "to-then-add":
            h = h + p.to(h.dtype).contiguous()
        elif self.how == "mul":
            h = h * p
        elif self.how == "logged-then-add":  # uses outside autograd capture nothing
            self.logged = (p.detach().norm(), p.shape, p.dtype, repr(p)[:10])
            h = h + p
        elif self.how == "add-twice":  # two broadcasts: G of their gradients' sum
            h = torch.tanh(h + p) + p
        elif self.how == "expand":  # an expand of its own: not seen through
            h = h + p.expand_as(h)
        return self.head(torch.tanh(h))


def factors(how: str, per_example: bool, flat: bool = False) -> dict[str, torch.Tensor]:
    model = PositionModel(how, per_example, flat).double()
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=None)
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1)).backward()
    precond.step()
    layer = precond.layers["pos"]
    return {"A": layer.factor("A"), "G": layer.factor("G")}


@pytest.mark.parametrize(
    "how",
    ["add", "radd", "iadd", "torch.add", "to-then-add", "mul", "logged-then-add", "add-twice"],
)
def test_broadcast_position_embedding_has_per_example_factors(how: str) -> None:
    want = factors(how, per_example=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kaisa")
        got = factors(how, per_example=False)
    for name in ("A", "G"):
        err = float((got[name] - want[name]).norm() / want[name].norm())
        assert err <= 1e-12, (name, err)


@pytest.mark.parametrize("how", ["add", "radd", "iadd", "torch.add", "mul", "add-twice"])
def test_position_ids_without_a_batch_dimension_have_per_example_factors(how: str) -> None:
    """ids ``[T]``: the output ``[T, d]`` is broadcast over a dimension the
    addition prepends, and read there per example, as from ``[1, T]``."""
    want = factors(how, per_example=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="kaisa")
        got = factors(how, per_example=False, flat=True)
    for name in ("A", "G"):
        err = float((got[name] - want[name]).norm() / want[name].norm())
        assert err <= 1e-12, (name, err)


def test_a_use_that_is_not_an_elementwise_broadcast_keeps_the_warning() -> None:
    with pytest.warns(UserWarning, match="saw 1 data point"):
        got = factors("expand", per_example=False)
    want = factors("expand", per_example=True)
    assert not torch.allclose(got["G"], want["G"])  # the batch-summed gradient, as reported


class Residual(nn.Module):
    """An embedding whose output feeds two branches (a residual)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + torch.tanh(self.mix(h)))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_batch_of_one_sequence_reads_the_outputs_whole_gradient(batch: int) -> None:
    """ids ``[1, T]`` are also a genuine batch of one sequence: G is formed
    from the output's gradient, the sum over the branches it feeds, as at
    any other batch size (its definition, from a hook that sees the output
    before kaisa does)."""
    model = Residual().double()
    seen: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.__setitem__("g", g.detach().clone()))

    model.emb.register_forward_hook(keep)
    precond = KFACPreconditioner(model, damping=0.01, kl_clip=None)
    ids = torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(1))
    logits = model(ids).reshape(-1, V)
    F.cross_entropy(logits, ids.reshape(-1), reduction="none").reshape(batch, T).sum(
        1
    ).mean().backward()
    precond.step()
    ghat = seen["g"].reshape(-1, D) * batch  # a loss averaged over the batch: ĝ = N·g
    want = ghat.t() @ ghat / batch
    got = precond.layers["emb"].factor("G")
    assert float((got - want).norm() / want.norm()) <= 1e-12


def test_hooks_on_the_output_see_its_gradient_as_without_kaisa() -> None:
    """A tensor hook, or ``retain_grad``, on an output kaisa wraps (ids
    ``[1, T]``) is the output's own: it fires once, with the whole gradient."""

    def run(with_kaisa: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        model = Residual().double()
        if with_kaisa:
            KFACPreconditioner(model)
        fired: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []

        def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
            out.register_hook(lambda g: fired.append(g.detach().clone()))
            out.retain_grad()
            outputs.append(out)

        model.emb.register_forward_hook(hook)
        ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(1))
        F.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1)).backward()
        grad = outputs[0].grad
        assert grad is not None
        return fired, grad

    (want,), want_retained = run(False)
    fired, retained = run(True)
    assert len(fired) == 1
    torch.testing.assert_close(fired[0], want, rtol=0, atol=0)
    torch.testing.assert_close(retained, want_retained, rtol=0, atol=0)
