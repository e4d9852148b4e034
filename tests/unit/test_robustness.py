"""Robustness of the public API in real training loops.

Each section is one promised behaviour (docs/getting-started.md, "Real training loops"):

1. a deep copy / pickle of the model after attaching captures nothing;
2. ``load_state_dict`` validates everything before changing anything;
3. ``step()`` twice with no backward is an error, normal loops are not;
4. a weight tied between an Embedding and a Linear head is preconditioned once, as the
   head, and reported (or left alone when skipped);
5. frozen layers are registered and preconditioned once unfrozen;
6. layer names do not depend on ``torch.compile`` / DataParallel wrappers;
7. every argument of a wrong type is an error naming it;
8. a training-mode forward with no backward is ignored, with a warning;
9. activation checkpointing gives the factors of the plain model;
10. a backward that leaves the parameters' gradients alone (input gradients for a
    gradient penalty or a saliency map) adds nothing to G.

Only the public API is used: ``step()``, ``describe()``, ``state_dict()`` /
``load_state_dict()``, ``paused()``, ``steps`` and the names in ``layers``.
Everything runs in float64 on tiny models, so "equal" means bit-for-bit
unless a tolerance is given.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from kaisa import KFACPreconditioner
from kaisa.torch_support import COMPILE_FLOOR

LAYERS = ("stem", "hidden", "classifier")


# -- helpers -----------------------------------------------------------------------------


def mlp() -> nn.Sequential:
    """Three Linear layers with distinctive names (so error messages can be checked)."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            stem=nn.Linear(6, 8),
            act1=nn.Tanh(),
            hidden=nn.Linear(8, 8),
            act2=nn.Tanh(),
            classifier=nn.Linear(8, 3),
        )
    ).double()


def batch(n: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=g)


def train_step(model: nn.Module, precond: KFACPreconditioner, opt, seed: int) -> None:
    x, y = batch(seed=seed)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    precond.step()
    opt.step()


def factors(precond: KFACPreconditioner) -> dict[str, dict[str, Tensor]]:
    """The running factors, copied (``state_dict()['layers']``)."""
    return {
        name: {key: value.detach().clone() for key, value in entry.items()}
        for name, entry in precond.state_dict(include_second_order=False)["layers"].items()
    }


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Recursive, exact equality of nested mappings/sequences of tensors and values."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        assert isinstance(a, Tensor) and isinstance(b, Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), where
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_factors_close(got: dict, want: dict, tol: float) -> None:
    assert set(got) == set(want)
    for name in want:
        assert set(got[name]) == set(want[name]) == {"A", "G"}, name
        for key in ("A", "G"):
            a, b = got[name][key], want[name][key]
            err = float((a - b).norm() / b.norm().clamp_min(1e-300))
            assert err <= tol, f"{name}.{key}: relative error {err:.3e}"


def grads(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _step_and_record(
    model: nn.Module, precond: KFACPreconditioner, opt: Any, fs: list[dict], gs: list[list]
) -> None:
    """``step()``, then record the preconditioned gradients, then the optimizer
    step, then the factors."""
    precond.step()
    gs.append(grads(model))
    opt.step()
    fs.append(factors(precond))


def has_no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# -- 1. deep copies and pickling -------------------------------------------------------------


def _run_with_teacher(teacher_from_step: int | None) -> tuple[list[Tensor], dict]:
    """3 K-FAC steps; from ``teacher_from_step`` on, a deep copy also trains alongside.

    The teacher's forward and backward are interleaved with the student's
    (teacher forward, student forward, teacher backward, student backward),
    on other data.
    """
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=1, inv_update_steps=1, damping=0.01
    )
    teacher = None
    for i in range(3):
        if teacher_from_step is not None and i == teacher_from_step:
            teacher = copy.deepcopy(model)
            teacher.train()
        x, y = batch(seed=i)
        opt.zero_grad()
        teacher_loss = None
        if teacher is not None:
            tx, ty = batch(seed=100 + i)
            teacher_loss = F.cross_entropy(teacher(tx), ty)
        loss = F.cross_entropy(model(x), y)
        if teacher_loss is not None:
            teacher_loss.backward()
        loss.backward()
        if teacher is not None:  # and once more between backward and step()
            tx, ty = batch(seed=200 + i)
            F.cross_entropy(teacher(tx), ty).backward()
        precond.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], factors(precond)


@pytest.mark.parametrize("teacher_from_step", [0, 1], ids=["copied-at-attach", "copied-mid-run"])
def test_deep_copied_teacher_captures_nothing(teacher_from_step: int) -> None:
    plain_params, plain_factors = _run_with_teacher(None)
    params, got_factors = _run_with_teacher(teacher_from_step)
    assert_same(got_factors, plain_factors, "factors")
    for a, b in zip(params, plain_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle", "torch.save"])
def test_copying_the_preconditioner_is_refused_with_the_way_that_works(how: str) -> None:
    """A copy is bound to nothing: the copied model's hooks are inert, so it
    preconditioned with frozen factors forever, silently.  The error names
    what works, and that way continues the run exactly."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, factor_update_steps=1)
    train_step(model, precond, opt, seed=0)
    copies = {
        "deepcopy": lambda: copy.deepcopy((model, opt, precond)),
        "copy": lambda: copy.copy(precond),
        "pickle": lambda: pickle.dumps(precond),
        "torch.save": lambda: torch.save(precond, io.BytesIO()),
    }
    with pytest.raises(TypeError, match="load_state_dict"):
        copies[how]()
    model_copy, opt_copy = copy.deepcopy((model, opt))
    new = KFACPreconditioner(model_copy, optimizer=opt_copy, factor_update_steps=1)
    new.load_state_dict(precond.state_dict())
    for seed in (1, 2):
        train_step(model, precond, opt, seed=seed)
        train_step(model_copy, new, opt_copy, seed=seed)
    assert_same(new.state_dict(), precond.state_dict())


@pytest.mark.parametrize("name", ["model", "optimizer", "grad_scaler"])
def test_what_the_preconditioner_is_bound_to_cannot_be_reassigned(name: str) -> None:
    """An assignment changed what the attribute read and nothing it did: a new
    optimizer's lr never reached the KL clip, and a skipped step took the
    gradients of the old optimizer's parameters only."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt)
    before = getattr(precond, name)
    with pytest.raises(AttributeError, match=f"precond.{name} is fixed at construction"):
        setattr(precond, name, torch.optim.SGD(model.parameters(), lr=0.01))
    assert getattr(precond, name) is before


def test_a_registered_module_replaced_in_the_model_is_told_of() -> None:
    """``model.hidden = nn.Linear(...)`` after the build: the new module is
    not preconditioned (its hooks were never registered), which was silent.
    A frozen layer, whose hooks do not capture either, is not mistaken for it."""
    model = mlp()
    model.stem.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, factor_update_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(model, precond, opt, seed=0)
    model.hidden = nn.Linear(8, 8).double()
    opt.add_param_group({"params": model.hidden.parameters()})
    with pytest.warns(UserWarning, match="layer 'hidden' is no longer part of the model"):
        train_step(model, precond, opt, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        train_step(model, precond, opt, seed=2)


def test_model_pickles_and_saves_after_attaching() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt)
    train_step(model, precond, opt, seed=0)

    unpickled = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)

    before = factors(precond)
    x, y = batch(seed=7)
    with torch.no_grad():
        expected = model(x)
    for clone in (unpickled, loaded):
        clone.train()
        out = clone(x)
        assert torch.equal(out, expected)
        F.cross_entropy(out, y).backward()  # the copies train, and capture nothing
    # the original still trains, and the copies' passes left nothing in its factors
    train_step(model, precond, opt, seed=1)
    reference_model = mlp()
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    reference = KFACPreconditioner(reference_model, optimizer=reference_opt)
    train_step(reference_model, reference, reference_opt, seed=0)
    assert_same(before, factors(reference), "factors after one step")
    train_step(reference_model, reference, reference_opt, seed=1)
    assert_same(factors(precond), factors(reference), "factors after two steps")
    for a, b in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(a, b)


# -- 2. load_state_dict is all or nothing -------------------------------------------------------


def _trained_pair() -> tuple[nn.Module, Any, KFACPreconditioner, dict]:
    """A run of 4 steps and the state_dict it had after 2 (different factors)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=1, inv_update_steps=2, damping=0.01
    )
    for i in range(2):
        train_step(model, precond, opt, seed=i)
    saved = copy.deepcopy(precond.state_dict())
    for i in range(2, 4):
        train_step(model, precond, opt, seed=i)
    return model, opt, precond, saved


def _corrupt_shape(layer: str, key: str) -> Callable[[dict], None]:
    def corrupt(state: dict) -> None:
        n = state["layers"][layer][key].shape[0]
        state["layers"][layer][key] = torch.zeros(n + 1, n + 1, dtype=torch.float64)

    return corrupt


def _corrupt_values(layer: str, key: str, how: str) -> Callable[[dict], None]:
    """``layer.key`` (the last layer's, so a check that changed the earlier
    ones first would show) with a NaN or an Inf, as bools, without data, or
    as a factor no Gram matrix can be (not symmetric, a negative diagonal)."""

    def corrupt(state: dict) -> None:
        entry = state["layers"][layer]
        # "second-order": the last of the second-order tensors this method holds
        second_order = sorted(k for k in entry if k not in ("A", "G"))
        key_ = key if key in entry else second_order[-1]
        value = entry[key_].clone()
        if how == "nan":
            value.view(-1)[0] = float("nan")
        elif how == "inf":
            value.view(-1)[-1] = float("inf")
        elif how == "bool":
            value = value != 0
        elif how == "asymmetric":
            value[0, -1] += 1.0
        elif how == "negative-diagonal":
            value[-1, -1] = -abs(float(value[-1, -1])) - 1.0
        else:
            value = torch.empty_like(value, device="meta")
        entry[key_] = value

    return corrupt


def _set_version(state: dict) -> None:
    state["version"] = 99


def _set_hyperparameters(state: dict) -> None:
    state["hyperparameters"] = [1, 2]


def _add_unknown_layer(state: dict) -> None:
    state["layers"]["bogus_layer"] = {k: v.clone() for k, v in state["layers"]["hidden"].items()}


def _set_steps(value: Any) -> Callable[[dict], None]:
    def corrupt(state: dict) -> None:
        state["steps"] = value

    return corrupt


def test_a_factor_saved_as_none_is_read_as_not_formed_yet() -> None:
    """kfac-pytorch saves a layer it has not captured yet as
    ``{'A': None, 'G': None}``; such a checkpoint (taken before its first
    factor update) was refused as damaged.  It loads as one without those
    factors: the run equals a fresh preconditioner's."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, factor_update_steps=1)
    names = list(precond.layers)
    precond.load_state_dict({"steps": 0, "layers": {n: {"A": None, "G": None} for n in names}})
    assert not any(la.captured for la in precond.layers.values())
    twin_model = mlp()
    twin_opt = torch.optim.SGD(twin_model.parameters(), lr=0.1)
    twin = KFACPreconditioner(twin_model, optimizer=twin_opt, factor_update_steps=1)
    for seed in range(2):
        train_step(model, precond, opt, seed=seed)
        train_step(twin_model, twin, twin_opt, seed=seed)
    assert_same(precond.state_dict(), twin.state_dict())


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("method", ["inverse", "eigen", "ekfac"])
def test_a_checkpoint_saved_before_a_pending_recompute_resumes_as_its_source(
    method: str, sharded: bool
) -> None:
    """A factors-only checkpoint leaves the inverses to the next step; saved
    again before that step, the new checkpoint held damping-only stand-ins
    as if they were decomposed, and a resume from it never recomputed them.
    It now leaves them out too, and its resume equals its source's."""
    options = dict(factor_update_steps=1, inv_update_steps=3, damping=0.1, compute_method=method)

    def fresh() -> tuple[nn.Module, Any, KFACPreconditioner]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, KFACPreconditioner(model, optimizer=opt, **options)

    model, opt, precond = fresh()
    for seed in range(4):
        train_step(model, precond, opt, seed=seed)
    weights, saved = (
        copy.deepcopy(model.state_dict()),
        precond.state_dict(include_second_order=False),
    )

    def resumed(load: Callable[[KFACPreconditioner], None]) -> tuple[nn.Module, Any, Any]:
        m, o, p = fresh()
        m.load_state_dict(weights)
        load(p)
        return m, o, p

    first = resumed(lambda p: p.load_state_dict(saved))
    if sharded:
        again = first[2].sharded_state_dict()
        assert not any(bool(flag) for flag in again["held"].values())
        second = resumed(lambda p: p.load_sharded_state_dict(copy.deepcopy(again)))
    else:
        again = first[2].state_dict()
        assert all(set(entry) == {"A", "G"} for entry in again["layers"].values())
        second = resumed(lambda p: p.load_state_dict(again))
    for seed in (4, 5):
        for m, o, p in (first, second):
            train_step(m, p, o, seed=seed)
    for a, b in zip(first[0].parameters(), second[0].parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("large_factor", "how", "match"),
    [
        ("block", "asymmetric", "hidden.A is not symmetric"),
        ("block", "negative-diagonal", "hidden.A has a negative diagonal entry"),
        ("diagonal", "negative-diagonal", "hidden.A has a negative diagonal entry"),
    ],
)
def test_a_stored_factor_no_gram_matrix_can_be_is_refused(
    large_factor: str, how: str, match: str
) -> None:
    """A block-diagonal factor is checked block by block (its flat storage
    is no matrix), a diagonal one entry by entry."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the factors kept sparse are named
        precond = KFACPreconditioner(
            model, optimizer=opt, max_factor_dim=4, large_factor=large_factor
        )
    train_step(model, precond, opt, seed=0)
    before = copy.deepcopy(precond.state_dict())
    bad = copy.deepcopy(before)
    a = bad["layers"]["hidden"]["A"]  # 9 rows: blocks 3×3, or a diagonal of 9
    if how == "asymmetric":
        a[1] += 1.0  # row 0, column 1 of the first 3×3 block
    else:
        a[-1] = -1.0  # the last block's last diagonal entry, or the diagonal's
    with pytest.raises(ValueError, match=match):
        precond.load_state_dict(bad)
    assert_same(precond.state_dict(), before)
    precond.load_state_dict(before)  # the factor as saved loads


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (_corrupt_shape("hidden", "A"), "hidden"),
        (_corrupt_shape("classifier", "A"), "classifier"),
        (_corrupt_shape("classifier", "G"), "classifier"),
        (_add_unknown_layer, "bogus_layer"),
        (_set_steps(-1), "steps"),
        (_set_steps("3"), "steps"),
        (_set_steps(2.5), "steps"),
        (_set_steps(None), "steps"),
        (_corrupt_values("classifier", "G", "nan"), "classifier.G holds NaN"),
        (_corrupt_values("classifier", "second-order", "inf"), "classifier.* holds NaN or Inf"),
        (_corrupt_values("classifier", "A", "bool"), "classifier.A is of dtype torch.bool"),
        (_corrupt_values("classifier", "G", "meta"), "classifier.G is a meta tensor"),
        (_corrupt_values("classifier", "A", "asymmetric"), "classifier.A is not symmetric"),
        (
            _corrupt_values("classifier", "G", "negative-diagonal"),
            "classifier.G has a negative diagonal entry",
        ),
        (_set_version, "version"),
        (_set_hyperparameters, "hyperparameters"),
    ],
    ids=[
        "hidden.A-shape",
        "classifier.A-shape",
        "classifier.G-shape",
        "unknown-layer",
        "steps=-1",
        "steps='3'",
        "steps=2.5",
        "steps=None",
        "classifier.G-nan",
        "classifier-second-order-inf",
        "classifier.A-bool",
        "classifier.G-meta",
        "classifier.A-asymmetric",
        "classifier.G-negative-diagonal",
        "version=99",
        "hyperparameters-a-list",
    ],
)
def test_load_state_dict_validates_everything_before_changing_anything(corrupt, match) -> None:
    model, opt, precond, saved = _trained_pair()
    before = copy.deepcopy(precond.state_dict())
    steps_before = precond.steps
    # the saved factors differ from the current ones, so a partial load would show
    assert not torch.equal(saved["layers"]["stem"]["A"], before["layers"]["stem"]["A"])
    assert saved["steps"] != steps_before

    bad = copy.deepcopy(saved)
    corrupt(bad)
    with pytest.raises(ValueError, match=match):
        precond.load_state_dict(bad)

    assert precond.steps == steps_before
    assert_same(precond.state_dict(), before)

    # the next step is that of a twin that never saw the bad checkpoint
    twin_model, twin_opt, twin, _ = _trained_pair()
    train_step(model, precond, opt, seed=4)
    train_step(twin_model, twin, twin_opt, seed=4)
    assert_same(precond.state_dict(), twin.state_dict())
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)

    # and the uncorrupted checkpoint does load
    precond.load_state_dict(saved)
    assert precond.steps == saved["steps"]
    assert_same(precond.state_dict()["layers"], saved["layers"])


# -- 3. step() twice without backward --------------------------------------------------------------


@pytest.mark.parametrize("warmup_steps", [0, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("factor_update_steps", [1, 3])
def test_step_twice_without_backward_is_an_error(
    warmup_steps: int, set_to_none: bool, factor_update_steps: int
) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        factor_update_steps=factor_update_steps,
        inv_update_steps=factor_update_steps,
    )
    for i in range(warmup_steps):
        x, y = batch(seed=i)
        opt.zero_grad(set_to_none=set_to_none)
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()
    x, y = batch(seed=9)
    opt.zero_grad(set_to_none=set_to_none)
    F.cross_entropy(model(x), y).backward()
    precond.step()
    once = grads(model)
    steps = precond.steps
    with pytest.raises(RuntimeError, match="backward"):
        precond.step()
    # the refused step changed nothing
    assert precond.steps == steps
    for a, b in zip(grads(model), once):
        assert a is not None and b is not None and torch.equal(a, b)


def _loop(kind: str) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options: dict[str, Any] = {}
    if kind == "factor_update_steps=3":
        options = dict(factor_update_steps=3, inv_update_steps=3)
    if kind == "accumulation=2":
        options = dict(accumulation_steps=2)
    precond = KFACPreconditioner(model, optimizer=opt, **options)
    for i in range(6):
        opt.zero_grad(set_to_none=kind != "set_to_none=False")
        if kind == "accumulation=2":
            for j in range(2):
                x, y = batch(8, seed=10 * i + j)
                (F.cross_entropy(model(x), y) / 2).backward()
        else:
            x, y = batch(seed=i)
            F.cross_entropy(model(x), y).backward()
        raw = grads(model)
        precond.step()
        if kind == "clip_grad_norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        assert any(not torch.equal(a, b) for a, b in zip(grads(model), raw))
    assert precond.steps == 6


@pytest.mark.parametrize(
    "kind",
    [
        "set_to_none=True",
        "set_to_none=False",
        "factor_update_steps=3",
        "clip_grad_norm",
        "accumulation=2",
    ],
)
def test_normal_training_loops_never_trip_the_double_step_guard(kind: str) -> None:
    _loop(kind)  # must not raise


# -- 4. tied weights ----------------------------------------------------------------------------


class TiedLM(nn.Module):
    """Embedding → Linear → tanh → Linear head whose weight is the embedding's."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        if head_first:  # the head comes first in named_modules()
            self.head = nn.Linear(8, 11, bias=False)
            self.emb = nn.Embedding(11, 8)
        else:
            self.emb = nn.Embedding(11, 8)
            self.head = nn.Linear(8, 11, bias=False)
        self.hidden = nn.Linear(8, 8)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(tokens))))


@pytest.mark.parametrize("head_first", [False, True], ids=["emb-first", "head-first"])
def test_tied_embedding_head_is_reported(head_first: bool) -> None:
    """By default the tied weight is preconditioned once, as the head (see
    test_layer_types for its definition), and describe() says so; skipped by
    skip_layers it is left alone, reported, and its gradient untouched."""
    model = TiedLM(head_first).double()
    assert model.head.weight is model.emb.weight
    precond = KFACPreconditioner(model, damping=0.01)
    assert {"hidden", "head"} <= set(precond.layers) and "emb" not in precond.layers
    text = precond.describe()
    assert "tied to emb.weight" in text and "emb" in {s.name for s in precond.skipped}, text

    left_alone = KFACPreconditioner(TiedLM(head_first).double(), skip_layers=["^head$"])
    model = left_alone.model
    assert "head" not in left_alone.layers and "emb" not in left_alone.layers
    lines = left_alone.describe().splitlines()
    header = next(
        (i for i, line in enumerate(lines) if "left to the optimizer" in line.lower()), None
    )
    assert header is not None, left_alone.describe()
    emb_lines = [line for line in lines[header + 1 :] if line.split()[:1] == ["emb"]]
    assert emb_lines and "tied" in emb_lines[0], left_alone.describe()

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (4, 5), generator=g)
    targets = torch.randint(0, 11, (4, 5), generator=g)
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(tokens).reshape(-1, 11), targets.reshape(-1)).backward()
        shared = model.emb.weight.grad.clone()
        hidden = model.hidden.weight.grad.clone()
        left_alone.step()
        assert torch.equal(model.emb.weight.grad, shared)
        assert not torch.allclose(model.hidden.weight.grad, hidden)


# -- 5. frozen layers ------------------------------------------------------------------------------


@pytest.mark.parametrize("frozen", LAYERS)
def test_frozen_layer_is_registered_and_preconditioned_once_unfrozen(frozen: str) -> None:
    model = mlp()
    layer = getattr(model, frozen)
    layer.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model,
        optimizer=opt,
        factor_update_steps=1,
        inv_update_steps=1,
        damping=0.01,
        kl_clip=None,
    )
    assert frozen in precond.layers
    frozen_weight = layer.weight.detach().clone()
    for i in range(2):
        train_step(model, precond, opt, seed=i)
        assert layer.weight.grad is None and layer.bias.grad is None
    assert torch.equal(layer.weight, frozen_weight)

    layer.requires_grad_(True)
    x, y = batch(seed=5)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw_w, raw_b = layer.weight.grad.clone(), layer.bias.grad.clone()
    precond.step()
    new_w, new_b = layer.weight.grad, layer.bias.grad
    raw = torch.cat([raw_w, raw_b[:, None]], 1).flatten()
    new = torch.cat([new_w, new_b[:, None]], 1).flatten()
    # preconditioned: not merely rescaled (as the damping-only fallback would)
    cosine = float(torch.dot(raw, new) / (raw.norm() * new.norm()))
    assert cosine < 1 - 1e-6, cosine
    assert set(precond.state_dict(include_second_order=False)["layers"][frozen]) == {"A", "G"}


# -- 6. names through wrappers ----------------------------------------------------------------------


def _one_step_factors(wrapped: nn.Module, inner: nn.Module) -> dict[str, dict[str, Tensor]]:
    precond = KFACPreconditioner(wrapped, damping=0.01)
    x, y = batch(seed=3)
    inner.zero_grad()
    F.cross_entropy(wrapped(x), y).backward()
    precond.step()
    return factors(precond)


def _prefixed(state: dict, prefix: str) -> dict:
    out = copy.deepcopy(state)
    out["layers"] = {prefix + name: entry for name, entry in out["layers"].items()}
    return out


def test_compiled_model_has_the_eager_layer_names() -> None:
    eager = KFACPreconditioner(mlp())
    compiled = KFACPreconditioner(torch.compile(mlp(), backend="eager"))
    assert list(compiled.layers) == list(eager.layers) == list(LAYERS)
    assert not any("_orig_mod" in name for name in compiled.layers)


def test_an_entry_the_preconditioner_does_not_know_is_named_in_a_warning() -> None:
    """A misspelt or foreign key is ignored, and says so (the rest loads)."""
    _, _, precond, saved = _trained_pair()
    saved["layers"]["hidden"]["QA"] = saved["layers"]["hidden"]["A"].clone()
    with pytest.warns(UserWarning, match=r"'hidden' holds entries .* \['QA'\]"):
        precond.load_state_dict(saved)
    assert precond.steps == saved["steps"]


def test_checkpoints_move_between_compiled_and_eager_models() -> None:
    # (no forward through the compiled model: dynamo's warm-up alone takes seconds)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager = KFACPreconditioner(model, optimizer=opt)
    train_step(model, eager, opt, seed=0)
    state = eager.state_dict()

    compiled = KFACPreconditioner(torch.compile(mlp(), backend="eager"))
    compiled.load_state_dict(state)  # eager → compiled
    saved = compiled.state_dict()
    assert list(saved["layers"]) == list(LAYERS)
    assert_same(saved["layers"], state["layers"])

    target = KFACPreconditioner(mlp())
    target.load_state_dict(saved)  # compiled → eager
    assert target.steps == 1
    assert_same(target.state_dict()["layers"], state["layers"])


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module."])
def test_state_dict_with_wrapper_prefixes_loads(prefix: str) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = KFACPreconditioner(model, optimizer=opt)
    train_step(model, source, opt, seed=0)
    state = source.state_dict()
    old = _prefixed(state, prefix)
    for target_model in (mlp(), torch.compile(mlp(), backend="eager"), nn.DataParallel(mlp())):
        target = KFACPreconditioner(target_model)
        target.load_state_dict(old)
        assert target.steps == 1
        loaded = target.state_dict()["layers"]  # on cuda:0 under DataParallel on a GPU machine
        loaded = {n: {k: v.cpu() for k, v in e.items()} for n, e in loaded.items()}
        assert_same(loaded, state["layers"])


CPU_DATA_PARALLEL = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="nn.DataParallel moves the module to cuda:0 where a GPU exists; this is its CPU path",
)


@CPU_DATA_PARALLEL
def test_data_parallel_on_cpu_has_the_plain_layer_names() -> None:
    eager_model = mlp()
    want = _one_step_factors(eager_model, eager_model)
    inner = mlp()
    wrapped = nn.DataParallel(inner)
    precond = KFACPreconditioner(wrapped)
    assert list(precond.layers) == list(LAYERS)
    got = _one_step_factors(wrapped, inner)
    assert_factors_close(got, want, 1e-12)
    plain = KFACPreconditioner(mlp())
    plain.load_state_dict({"steps": 1, "layers": got})
    assert_same(factors(plain), got)


@pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")
@pytest.mark.parametrize(
    "wrap", ["compile", pytest.param("compile(DataParallel)", marks=CPU_DATA_PARALLEL)]
)
def test_training_through_compiled_models_equals_eager(wrap: str) -> None:
    # one forward/backward through dynamo (eager backend: hooks traced, ~1 s)
    eager_model = mlp()
    want = _one_step_factors(eager_model, eager_model)
    inner = mlp()
    wrapped = torch.compile(inner if wrap == "compile" else nn.DataParallel(inner), backend="eager")
    got = _one_step_factors(wrapped, inner)
    assert list(got) == list(LAYERS)
    assert_factors_close(got, want, 1e-12)


# -- 7. argument types -----------------------------------------------------------------------------


class Opaque:
    """An object of no meaningful type (with a stable repr for test ids)."""

    def __repr__(self) -> str:
        return "Opaque()"


BAD_ARGUMENTS: list[tuple[str, Any]] = [
    ("factor_update_steps", "1"),
    ("factor_update_steps", 1.5),
    ("factor_update_steps", None),
    ("inv_update_steps", "1"),
    ("inv_update_steps", [1]),
    ("damping", "0.1"),
    ("damping", None),
    ("damping", [0.1]),
    ("factor_decay", "0.9"),
    ("factor_decay", None),
    ("kl_clip", "0.001"),
    ("kl_clip", [0.001]),
    ("lr", "0.1"),
    ("lr", [0.1]),
    ("accumulation_steps", "2"),
    ("accumulation_steps", 1.5),
    ("accumulation_steps", [2]),  # None: the engine's, else 1 (test_preconditioner)
    ("compute_method", 3),
    ("compute_method", None),
    ("compute_eigenvalue_outer_product", "yes"),
    ("compute_eigenvalue_outer_product", None),
    ("symmetry_aware", "yes"),
    ("symmetry_aware", None),
    ("grad_worker_fraction", [0.5]),
    ("grad_worker_fraction", Opaque()),
    ("assignment_strategy", 3),
    ("assignment_strategy", None),
    ("colocate_factors", "no"),
    ("colocate_factors", None),
    ("allreduce_bucket_cap_mb", "25"),
    ("allreduce_bucket_cap_mb", None),
    ("factor_dtype", 5),
    ("factor_dtype", "float128"),
    ("inv_dtype", 5),
    ("inv_dtype", "float128"),
    ("skip_layers", 5),
    ("skip_layers", [5]),
    ("skip_layers", Opaque()),
    ("update_factors_in_hook", "yes"),
    ("update_factors_in_hook", None),
    ("loss_average", 3),
    ("loss_average", None),
    ("optimizer", "sgd"),
    ("optimizer", 5),
    ("grad_scaler", "x"),
    ("grad_scaler", 5),
    ("pg_timeout_s", "10"),
    ("pg_timeout_s", [10]),
    ("loglevel", "loud"),
    ("loglevel", 2.5),
]


@pytest.mark.parametrize(
    ("name", "value"), BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v in BAD_ARGUMENTS]
)
def test_wrong_argument_type_names_the_argument(name: str, value: Any) -> None:
    model = mlp()
    with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
        KFACPreconditioner(model, **{name: value})
    assert has_no_hooks(model)  # refused before anything was attached


@pytest.mark.parametrize("model", ["a string", None, 5, nn.Linear], ids=repr)
def test_wrong_model_type_names_the_argument(model: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=r"\bmodel\b"):
        KFACPreconditioner(model)


# -- 8. a forward with no backward ------------------------------------------------------------------


def _extra_forward_run(extra: str | None, in_hook: bool) -> tuple[list[dict], list[list[str]]]:
    """Two steps; on the first, an extra training-mode forward with no backward.

    ``extra``: None, "before" (a metric before the real forward, output
    dropped), "after" (after backward, output kept until after step()) or
    "paused" (before the real forward, inside ``precond.paused()``).
    Returns the factors after each step and the warnings of each step().
    """
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, damping=0.01, update_factors_in_hook=in_hook)
    out_factors, out_warnings = [], []
    for i in range(2):
        x, y = batch(seed=i)
        xe, ye = batch(8, seed=50 + i)
        opt.zero_grad()
        kept = None
        if i == 0 and extra == "before":
            accuracy = (model(xe).argmax(1) == ye).double().mean().item()
            assert 0.0 <= accuracy <= 1.0
        if i == 0 and extra == "paused":
            with precond.paused():
                kept = model(xe)
        F.cross_entropy(model(x), y).backward()
        if i == 0 and extra == "after":
            kept = model(xe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precond.step()
        del kept
        opt.step()
        out_factors.append(factors(precond))
        out_warnings.append([str(w.message) for w in caught])
    return out_factors, out_warnings


@pytest.mark.parametrize("in_hook", [True, False], ids=["in_hook", "deferred"])
@pytest.mark.parametrize("extra", ["before", "after"])
def test_forward_without_backward_warns_and_adds_nothing(extra: str, in_hook: bool) -> None:
    want, quiet = _extra_forward_run(None, in_hook)
    assert quiet == [[], []]
    got, caught = _extra_forward_run(extra, in_hook)
    assert any("paused()" in message for message in caught[0]), caught[0]
    assert caught[1] == []  # the dropped forward is reported once, not carried over
    assert_same(got[0], want[0], "factors after step 1")
    assert_same(got[1], want[1], "factors after step 2")


def test_forward_without_backward_warning_is_a_pytest_warning() -> None:
    model = mlp()
    precond = KFACPreconditioner(model)
    x, y = batch()
    model(batch(seed=1)[0])
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match=r"paused\(\)"):
        precond.step()


@pytest.mark.parametrize("in_hook", [True, False], ids=["in_hook", "deferred"])
def test_forward_inside_paused_is_silent_and_adds_nothing(in_hook: bool) -> None:
    want, _ = _extra_forward_run(None, in_hook)
    got, caught = _extra_forward_run("paused", in_hook)
    assert caught == [[], []]
    assert_same(got, want, "factors")


# -- 9. activation checkpointing ---------------------------------------------------------------------


class CheckpointedNet(nn.Module):
    """stem → [hidden1 → tanh → hidden2] (checkpointed or not) → head."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.stem = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))
        if self.mode == "plain":
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.mode == "reentrant")
        return self.head(torch.tanh(h))


def _checkpoint_run(mode: str, in_hook: bool) -> tuple[list[dict], list[list[Tensor | None]]]:
    model = CheckpointedNet(mode).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, damping=0.01, update_factors_in_hook=in_hook)
    out_factors, out_grads = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # torch 2.4's own checkpointing calls its deprecated torch.cpu.amp.autocast
        warnings.filterwarnings("ignore", r"`torch\.cpu\.amp\.autocast", FutureWarning)
        for i in range(2):
            x, y = batch(seed=i)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            _step_and_record(model, precond, opt, out_factors, out_grads)
    return out_factors, out_grads


@pytest.mark.parametrize("in_hook", [True, False], ids=["in_hook", "deferred"])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_activation_checkpointing_counts_each_forward_once(mode: str, in_hook: bool) -> None:
    want_factors, want_grads = _checkpoint_run("plain", in_hook)
    assert set(want_factors[0]) == {"stem", "block.0", "block.2", "head"}
    got_factors, got_grads = _checkpoint_run(mode, in_hook)  # raises on any warning
    for got, want in zip(got_factors, want_factors):
        assert_factors_close(got, want, 1e-12)
    for got_step, want_step in zip(got_grads, want_grads):
        for a, b in zip(got_step, want_step):
            assert a is not None and b is not None
            assert float((a - b).norm() / b.norm()) <= 1e-10


# -- 10. backward passes that do not reach the parameters ------------------------------------


def _input_gradient_run(extra: str | None, in_hook: bool = True) -> tuple[list[dict], list]:
    """Two K-FAC steps of ``cross_entropy``; on each, before the real backward,
    one more backward of another quantity (the squared outputs) through the
    same forward: ``"grad"`` by ``torch.autograd.grad`` with respect to the
    input, ``"inputs"`` by ``backward(inputs=[x])``, ``"params"`` by a plain
    ``backward()`` that does accumulate into the parameters (the control).
    Returns the factors and the preconditioned gradients after each step."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=1, inv_update_steps=1, damping=0.01,
        update_factors_in_hook=in_hook,
    )  # fmt: skip
    out_factors, out_grads = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if extra == "params":  # a second pass that reaches the parameters: said once
            warnings.filterwarnings("default", message="kaisa: 2 training passes")
        for i in range(2):
            x, y = batch(seed=i)
            x.requires_grad_(True)
            opt.zero_grad()
            out = model(x)
            other = out.square().sum()
            if extra == "grad":
                (saliency,) = torch.autograd.grad(other, x, retain_graph=True)
                assert saliency.abs().sum() > 0
            elif extra == "inputs":
                other.backward(inputs=[x], retain_graph=True)
            elif extra == "params":
                other.backward(retain_graph=True)
                opt.zero_grad()
            F.cross_entropy(out, y).backward()
            _step_and_record(model, precond, opt, out_factors, out_grads)
    return out_factors, out_grads


@pytest.mark.parametrize("in_hook", [True, False], ids=["in_hook", "deferred"])
@pytest.mark.parametrize("extra", ["grad", "inputs"])
def test_input_gradients_add_nothing_to_g(extra: str, in_hook: bool) -> None:
    want_factors, want_grads = _input_gradient_run(None, in_hook)
    got_factors, got_grads = _input_gradient_run(extra, in_hook)  # raises on any warning
    assert_same(got_factors, want_factors, "factors")
    assert_same(got_grads, want_grads, "preconditioned gradients")
    # the control: the same extra backward, had it reached the parameters, is a
    # second pass with other output gradients, and G would change
    with pytest.warns(UserWarning, match="2 training passes"):  # two passes, one step
        control, _ = _input_gradient_run("params", in_hook)
    assert not torch.equal(control[0]["classifier"]["G"], want_factors[0]["classifier"]["G"])
    assert torch.equal(control[0]["classifier"]["A"], want_factors[0]["classifier"]["A"])


def test_gradient_penalty_takes_g_from_the_backward_that_updates() -> None:
    """``loss + λ‖∂loss/∂x‖²`` (create_graph): G sees the output gradient of
    the backward that fills ``.grad``, once, not ``∂loss/∂out`` a second time."""
    seen: list[Tensor] = []

    def run(penalty: float) -> dict:
        model = mlp()
        precond = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        x, y = batch()
        x.requires_grad_(True)
        out = model(x)
        out.register_hook(lambda g: seen.append(g.detach().clone()))
        loss = F.cross_entropy(out, y)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + penalty * gx.square().sum()).backward()
        precond.step()
        return factors(precond)

    plain = run(0.0)
    seen.clear()
    penalised = run(10.0)
    assert len(seen) == 2  # the head's output gradient arrives in both backward passes ...
    assert not torch.equal(seen[0], seen[1])  # ... and differs between them
    # ... and G is the outer product of the second one only (cross_entropy's mean:
    # the rows are rescaled by the batch size, G = Σ ĝ ĝᵀ / n with ĝ = n·g)
    n = seen[1].shape[0]
    g_hat = n * seen[1]
    want = g_hat.T @ g_hat / n
    torch.testing.assert_close(penalised["classifier"]["G"], want, rtol=1e-12, atol=0)
    assert not torch.equal(penalised["classifier"]["G"], plain["classifier"]["G"])


def test_a_forward_whose_only_backward_is_an_input_gradient_warns_and_adds_nothing() -> None:
    """A saliency map on a separate forward is, for K-FAC, a forward with no backward."""
    want, _ = _extra_forward_run(None, True)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, damping=0.01)
    got = []
    for i in range(2):
        x, y = batch(seed=i)
        opt.zero_grad()
        if i == 0:
            xe = batch(8, seed=50)[0].requires_grad_(True)
            torch.autograd.grad(model(xe).max(1).values.sum(), xe)
        F.cross_entropy(model(x), y).backward()
        if i == 0:
            with pytest.warns(UserWarning, match=r"paused\(\)"):
                precond.step()
        else:
            precond.step()
        opt.step()
        got.append(factors(precond))
    assert_same(got, want, "factors")


def test_autograd_grad_with_respect_to_the_parameters_still_counts() -> None:
    """A loop that takes ``torch.autograd.grad(loss, params)`` and sets
    ``.grad`` itself: autograd cannot say whether such a backward fills
    ``.grad``, so it counts, as a ``backward()`` would."""

    def run(functional: bool) -> tuple[dict, list]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFACPreconditioner(model, optimizer=opt, factor_update_steps=1, damping=0.01)
        x, y = batch()
        loss = F.cross_entropy(model(x), y)
        if functional:
            params = list(model.parameters())
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        else:
            loss.backward()
        precond.step()
        return factors(precond), grads(model)

    assert_same(run(True), run(False), "factors and preconditioned gradients")


def test_a_backward_autograd_cannot_place_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where autograd's engine cannot say whether a backward fills ``.grad``
    (here its query raises an unknown error), the backward's output
    gradients stay out of G, with one warning: counting it could let a
    gradient penalty into the factors."""
    from kaisa.step.capture import hooks

    def unknown(node: object) -> bool:
        raise RuntimeError("engine state unavailable")

    def run(unreadable: bool) -> dict:
        model = mlp()
        precond = KFACPreconditioner(model, factor_update_steps=1, damping=0.01, lr=0.1)
        x, y = batch(seed=0)
        F.cross_entropy(model(x), y).backward()
        precond.step()
        x, y = batch(seed=1)
        model.zero_grad()
        if unreadable:
            with monkeypatch.context() as m:
                m.setattr(torch._C, "_will_engine_execute_node", unknown)
                F.cross_entropy(model(x), y).backward()
        precond.step()
        return factors(precond)

    monkeypatch.setattr(hooks, "_WARNED_UNREADABLE", [])
    with pytest.warns(RuntimeWarning, match="could not say whether this backward") as seen:
        got = run(True)
    assert sum("could not say" in str(w.message) for w in seen) == 1  # once, not per layer
    assert_same(got, run(False), "factors: the unreadable backward left out")


@pytest.mark.parametrize(
    ("option", "bad"),
    [("kl_clip", -1.0), ("lr", float("nan")), ("inv_update_steps", 0), ("damping", -1.0)],
)
def test_a_schedule_refused_at_a_step_leaves_the_state_as_it_was(option: str, bad: Any) -> None:
    """A callable whose value at step 2 is out of range is refused naming it,
    before the step folds its factors or decomposes them: the state is that
    of the step before, and the step count too."""
    good = {"kl_clip": 1e-3, "lr": 0.1, "inv_update_steps": 1, "damping": 0.01}[option]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs: dict[str, Any] = {"factor_update_steps": 1, "inv_update_steps": 1, "damping": 0.01}
    kwargs[option] = lambda s: bad if s == 2 else good
    precond = KFACPreconditioner(model, **kwargs)
    for seed in range(2):
        train_step(model, precond, opt, seed=seed)
    before = copy.deepcopy(precond.state_dict())
    with pytest.raises(ValueError, match=rf"{option}\(2\)"):
        train_step(model, precond, opt, seed=2)
    assert precond.steps == 2
    assert_same(precond.state_dict(), before)
