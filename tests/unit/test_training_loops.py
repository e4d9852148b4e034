"""The training loops users really write, in one process.

Deep copies of the model (EMA/teacher), checkpoints that are validated before
anything changes, a second ``step()`` with no backward, tied and frozen
layers, compiled and wrapped models, arguments of the wrong type, forwards
with no backward and activation checkpointing.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from kaisa import KFACPreconditioner

KW: dict[str, Any] = dict(damping=0.01, kl_clip=0.05)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def factors(precond: KFACPreconditioner) -> dict[str, dict[str, torch.Tensor]]:
    return precond.state_dict()["layers"]


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["steps"] == b["steps"]
    assert a["layers"].keys() == b["layers"].keys()
    for name, entry in a["layers"].items():
        assert entry.keys() == b["layers"][name].keys()
        for key, value in entry.items():
            assert torch.equal(value, b["layers"][name][key]), f"{name}.{key}"


# -- copies ------------------------------------------------------------------------------------


def train_with_teacher(teacher: bool) -> list[torch.Tensor]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **KW)
    copy_ = copy.deepcopy(model) if teacher else None
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        if copy_ is not None:
            F.cross_entropy(copy_(x.flip(0)), y).backward()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_deep_copy_of_attached_model_captures_nothing() -> None:
    for a, b in zip(train_with_teacher(False), train_with_teacher(True)):
        assert torch.equal(a, b)


def test_attached_model_pickles_and_saves() -> None:
    model = mlp()
    KFACPreconditioner(model)
    restored = pickle.loads(pickle.dumps(model))
    restored(batch(0)[0])  # its hooks are inert
    torch.save(model, io.BytesIO())


# -- checkpoints ------------------------------------------------------------------------------------


def trained() -> KFACPreconditioner:
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    return precond


@pytest.mark.parametrize("corruption", ["shape", "unknown-layer", "steps", "not-a-tensor"])
def test_load_state_dict_validates_before_changing_anything(corruption: str) -> None:
    bad = trained().state_dict()
    target = trained()
    target._parts.pipeline.steps = 5  # something a partial load would overwrite
    before = target.state_dict()
    if corruption == "shape":  # the LAST layer is wrong: the first must stay untouched
        bad["layers"]["2"]["A"] = torch.zeros(3, 3, dtype=torch.float64)
        match = r"2\.A has shape"
    elif corruption == "unknown-layer":
        bad["layers"]["ghost"] = {}
        match = "unexpected"
    elif corruption == "steps":
        bad["steps"] = -1
        match = "steps"
    else:
        bad["layers"]["2"]["G"] = [[1.0]]
        match = "not a tensor"
    bad["layers"]["0"]["A"] = bad["layers"]["0"]["A"] + 1.0
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(bad)
    assert_same_state(target.state_dict(), before)


# -- a second step() with no backward --------------------------------------------------------------


def test_step_twice_without_backward_raises() -> None:
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    with pytest.raises(RuntimeError, match="backward"):
        precond.step()


@pytest.mark.parametrize(
    "loop", ["set_to_none", "zero_in_place", "factor_every_3", "clip", "accumulate"]
)
def test_normal_loops_never_trip_the_double_step_guard(loop: str) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(KW)
    if loop == "factor_every_3":
        kwargs.update(factor_update_steps=3, inv_update_steps=3)
    if loop == "accumulate":
        kwargs.update(accumulation_steps=2)
    precond = KFACPreconditioner(model, **kwargs)
    for step in range(5):
        opt.zero_grad(set_to_none=loop != "zero_in_place")
        x, y = batch(step)
        parts = 2 if loop == "accumulate" else 1
        for xm, ym in zip(x.chunk(parts), y.chunk(parts)):
            (F.cross_entropy(model(xm), ym) / parts).backward()
        precond.step()
        if loop == "clip":
            nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
    assert precond.steps == 5


# -- tied and frozen layers ----------------------------------------------------------------------


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def test_tied_weight_is_reported_and_left_to_the_optimizer() -> None:
    model = TiedLM().double()
    precond = KFACPreconditioner(model, **KW)
    assert list(precond.layers) == ["mid"]
    report = precond.describe()
    left = report.split("Left to the optimizer")[1]
    head_line = next(line for line in left.splitlines() if line.strip().startswith("head"))
    assert "tied" in head_line and "emb.weight" in head_line
    tokens = torch.randint(0, 10, (4, 5))
    F.cross_entropy(model(tokens).reshape(-1, 10), tokens.reshape(-1)).backward()
    raw_tied = model.head.weight.grad.clone()
    raw_mid = model.mid.weight.grad.clone()
    precond.step()
    assert torch.equal(model.head.weight.grad, raw_tied)
    assert not torch.allclose(model.mid.weight.grad, raw_mid)


def test_frozen_layer_is_preconditioned_once_unfrozen() -> None:
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, **KW, inv_update_steps=10)
    assert list(precond.layers) == ["0", "2"]
    for step in range(2):
        opt.zero_grad()
        F.cross_entropy(model(batch(step)[0]), batch(step)[1]).backward()
        precond.step()
        assert model[0].weight.grad is None
        opt.step()
    model[0].requires_grad_(True)  # gradual unfreezing, off the inverse schedule
    opt.zero_grad()
    F.cross_entropy(model(batch(5)[0]), batch(5)[1]).backward()
    raw = model[0].weight.grad.clone()
    precond.step()
    assert not torch.allclose(model[0].weight.grad, raw)
    assert precond.layers["0"].decomposed


# -- wrapped and compiled models ------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", ["compile", "data_parallel", "compiled_data_parallel"])
def test_layer_names_do_not_depend_on_wrappers(wrap: str) -> None:
    model = mlp()
    net = {
        "compile": lambda m: torch.compile(m, backend="eager"),
        "data_parallel": nn.DataParallel,
        "compiled_data_parallel": lambda m: torch.compile(nn.DataParallel(m), backend="eager"),
    }[wrap](model)
    precond = KFACPreconditioner(net, **KW)
    assert list(precond.layers) == ["0", "2"]
    x, y = batch(0)
    F.cross_entropy(net(x), y).backward()
    precond.step()
    state = precond.state_dict()
    eager = KFACPreconditioner(mlp(), **KW)
    eager.load_state_dict(state)
    legacy = dict(state, layers={f"_orig_mod.{k}": v for k, v in state["layers"].items()})
    eager.load_state_dict(legacy)  # names written by older versions
    assert torch.equal(eager.layers["0"].factor("A"), precond.layers["0"].factor("A"))


# -- arguments ------------------------------------------------------------------------------------

BAD_ARGUMENTS = {
    "factor_update_steps": "3",
    "inv_update_steps": 1.5,
    "damping": "x",
    "factor_decay": [0.9],
    "kl_clip": "a",
    "lr": "b",
    "accumulation_steps": 0.5,
    "compute_method": 5,
    "compute_eigenvalue_outer_product": "yes",
    "symmetry_aware": 1,
    "grad_worker_fraction": [0.5],
    "assignment_strategy": 3,
    "colocate_factors": None,
    "allreduce_bucket_cap_mb": "25",
    "factor_dtype": 5,
    "inv_dtype": "int",
    "skip_layers": 5,
    "update_factors_in_hook": "no",
    "loss_average": 7,
    "optimizer": "sgd",
    "grad_scaler": "x",
    "gradient_access": 5,
    "pg_timeout_s": "10",
    "loglevel": "loud",
    "topology": 3,
    "engine": 4,
}


@pytest.mark.parametrize(("name", "value"), list(BAD_ARGUMENTS.items()))
def test_every_argument_of_a_wrong_type_is_named(name: str, value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=name):
        KFACPreconditioner(mlp(), **{name: value})


def test_model_of_a_wrong_type_is_named() -> None:
    with pytest.raises(TypeError, match="model"):
        KFACPreconditioner("model")  # type: ignore[arg-type]


# -- forwards with no backward, activation checkpointing ---------------------------------------------


def one_step(extra: str | None) -> tuple[KFACPreconditioner, list[str]]:
    model = mlp()
    precond = KFACPreconditioner(model, **KW)
    x, y = batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if extra == "bare":
            model(batch(1)[0])  # e.g. a metric in training mode
        elif extra == "paused":
            with precond.paused():
                model(batch(1)[0])
        F.cross_entropy(model(x), y).backward()
        precond.step()
    return precond, [str(w.message) for w in caught]


def test_forward_without_backward_adds_nothing_and_warns() -> None:
    plain, _ = one_step(None)
    for extra in ("bare", "paused"):
        precond, messages = one_step(extra)
        assert_same_state(precond.state_dict(), plain.state_dict())
        warned = any("paused()" in m for m in messages)
        assert warned == (extra == "bare")


class Checkpointed(nn.Module):
    def __init__(self, mode: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 7)
        self.head = nn.Linear(7, 3)
        self.mode = mode

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return self.head(self.block(x))
        return self.head(checkpoint(self.block, x, use_reentrant=self.mode == "reentrant"))


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_is_counted_once(mode: str) -> None:
    results = {}
    for m in (None, mode):
        model = Checkpointed(m).double()
        precond = KFACPreconditioner(model, **KW)
        x, y = batch(0)
        x.requires_grad_(m == "reentrant")  # reentrant checkpointing needs an input that does
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            F.cross_entropy(model(x), y).backward()
            precond.step()
        results[m] = factors(precond)
    for name, entry in results[None].items():
        for key, value in entry.items():
            got = results[mode][name][key]
            assert float((got - value).abs().max()) <= 1e-12 * float(value.abs().max())
