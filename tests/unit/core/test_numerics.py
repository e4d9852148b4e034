"""Every numerical path against a dense float64 reference (relative error ≤ 1e-8)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kfac_defaults import kfac_pytorch

from kfac_reference import (
    conv_patches,
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


#: on kaisa's shipped defaults; the tests here mean kfac-pytorch's values (kfac_pytorch)
pytestmark = pytest.mark.usefixtures("float64_default")


def ce_per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias))


def data(n: int = 12, d: int = 5, classes: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def reference_factors(model, layer, x, per_example_loss, bias=True):
    inp, zg = per_example_output_grads(model, layer, x, per_example_loss)
    rows = (
        inp.reshape(-1, inp.shape[-1])
        if not isinstance(layer, nn.Conv2d)
        else conv_patches(inp, layer)
    )
    if bias:
        rows = with_ones(rows)
    n = inp.shape[0]
    g_rows = (
        zg.reshape(-1, zg.shape[-1])
        if not isinstance(layer, nn.Conv2d)
        else zg.permute(0, 2, 3, 1).reshape(-1, zg.shape[1])
    )
    return outer_mean(rows), g_rows.t() @ g_rows / n


def kfac_step(model, loss_fn, x, **kwargs):
    """One K-FAC step; returns the preconditioner and the raw gradients."""
    kwargs.setdefault("damping", DAMPING)
    kwargs.setdefault("kl_clip", None)
    items = kwargs.pop("loss_items", None)
    precond = KFACPreconditioner(model, **kfac_pytorch(**kwargs))
    precond.loss_items = items
    model.zero_grad()
    loss_fn(model(x)).backward()
    raw = {
        name: grad_matrix(layer.adapter.module).clone() for name, layer in precond.layers.items()
    }
    precond.step()
    return precond, raw


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_linear_factors_and_preconditioned_gradient(bias: bool, method: str) -> None:
    model = mlp(bias)
    x, y = data()
    precond, raw = kfac_step(model, lambda out: F.cross_entropy(out, y), x, compute_method=method)
    for name, layer in precond.layers.items():
        module = layer.adapter.module
        A, G = reference_factors(model, module, x, lambda out: ce_per_example(out, y), bias)
        assert rel_err(layer.factor("A"), A) <= TOL
        assert rel_err(layer.factor("G"), G) <= TOL
        dense = dense_precondition if method == "eigen" else dense_precondition_pi
        expected = dense(raw[name], A, G, DAMPING)
        assert rel_err(grad_matrix(module), expected) <= TOL


def test_eigen_path_is_exact_damped_kronecker_inverse_not_pi_split() -> None:
    # Guards against the eigen path silently using the inverse path's damping.
    model = mlp()
    x, y = data()
    precond, raw = kfac_step(model, lambda out: F.cross_entropy(out, y), x)
    layer = next(iter(precond.layers.values()))
    A, G = layer.factor("A"), layer.factor("G")
    exact = dense_precondition(raw[layer.name], A, G, DAMPING)
    other = dense_precondition_pi(raw[layer.name], A, G, DAMPING)
    assert rel_err(grad_matrix(layer.adapter.module), exact) <= TOL
    assert rel_err(exact, other) > 1e-4


@pytest.mark.parametrize("loss_average", ["batch", "batch_and_sequence", "sum", "items"])
def test_sequence_linear_expand(loss_average: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 5))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 4, generator=g)  # N=3 sequences of T=7 tokens
    y = torch.randint(0, 5, (3, 7), generator=g)

    def per_token(out):
        return F.cross_entropy(out.reshape(-1, 5), y.reshape(-1), reduction="none").reshape(3, 7)

    losses = {
        "batch": lambda out: per_token(out).sum(1).mean(),
        "batch_and_sequence": lambda out: per_token(out).mean(),
        "sum": lambda out: per_token(out).sum(),
        "items": lambda out: per_token(out).sum() / 21,  # Σ ℓ / N, N given as loss_items
    }
    items = {"loss_items": 21} if loss_average == "items" else {}
    precond, raw = kfac_step(model, losses[loss_average], x, loss_average=loss_average, **items)
    for name, layer in precond.layers.items():
        module = layer.adapter.module
        # per-"term" gradients: d(sum of the averaged terms)/dz, scaled as the convention says
        inp, zg = per_example_output_grads(model, module, x, lambda out: per_token(out).sum(1))
        A = outer_mean(with_ones(inp.reshape(-1, inp.shape[-1])))
        # Whatever the averaging, ĝ is the gradient of one summed term: G = (1/N) Σ ĝ ĝᵀ.
        rows = zg.reshape(-1, zg.shape[-1])
        G = rows.t() @ rows / 3
        assert rel_err(layer.factor("A"), A) <= TOL
        assert rel_err(layer.factor("G"), G) <= TOL
        assert rel_err(grad_matrix(module), dense_precondition(raw[name], A, G, DAMPING)) <= TOL


CONV_CASES = [
    dict(kernel_size=3, stride=1, padding=1),
    dict(kernel_size=3, stride=2, padding=0),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2)),
    dict(kernel_size=3, stride=1, padding=2, dilation=2),
    dict(kernel_size=(2, 3), stride=1, padding="same", dilation=(1, 2)),
    dict(kernel_size=4, stride=1, padding="same"),
    dict(kernel_size=3, stride=2, padding="valid"),
    dict(kernel_size=3, stride=1, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, stride=2, padding=(2, 1), padding_mode="replicate", dilation=(1, 2)),
    dict(kernel_size=3, stride=1, padding="same", padding_mode="circular"),
    dict(kernel_size=3, stride=1, padding=1, bias=False),
]


@pytest.mark.parametrize(
    "case", CONV_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
def test_conv2d_factors_against_unfold(case: dict) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, **case)
    with torch.no_grad():
        out_hw = conv(torch.zeros(1, 2, 7, 6)).shape[-2:]
    model = nn.Sequential(
        conv, nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(3 * out_hw[0] * out_hw[1], 4)
    )
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 2, 7, 6, generator=g)
    y = torch.randint(0, 4, (5,), generator=g)
    # The reference patches reproduce the convolution itself (all padding modes, 'same', dilation).
    patches = conv_patches(x, conv)
    w = conv.weight.reshape(3, -1)
    direct = patches @ w.t() + (conv.bias if conv.bias is not None else 0)
    assert rel_err(direct, conv(x).permute(0, 2, 3, 1).reshape(-1, 3)) <= 1e-12

    precond, raw = kfac_step(model, lambda out: F.cross_entropy(out, y), x, compute_method="eigen")
    layer = precond.layers["0"]
    A, G = reference_factors(
        model, conv, x, lambda out: ce_per_example(out, y), conv.bias is not None
    )
    assert layer.factor("A").shape == (layer.adapter.a_dim,) * 2
    assert rel_err(layer.factor("A"), A) <= TOL
    assert rel_err(layer.factor("G"), G) <= TOL
    assert rel_err(grad_matrix(conv), dense_precondition(raw["0"], A, G, DAMPING)) <= TOL


def test_conv_inverse_path() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, dilation=1, stride=2)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 4))
    x = torch.randn(6, 2, 8, 8)
    y = torch.randint(0, 4, (6,))
    precond, raw = kfac_step(
        model, lambda out: F.cross_entropy(out, y), x, compute_method="inverse"
    )
    for name, layer in precond.layers.items():
        expected = dense_precondition_pi(raw[name], layer.factor("A"), layer.factor("G"), DAMPING)
        assert rel_err(grad_matrix(layer.adapter.module), expected) <= TOL


@pytest.mark.parametrize("kl_clip", [1e-6, 1e6])
def test_kl_clip(kl_clip: float) -> None:
    model = mlp()
    x, y = data()
    lr = 0.3
    precond, raw = kfac_step(model, lambda out: F.cross_entropy(out, y), x, kl_clip=kl_clip, lr=lr)
    dense = {
        n: dense_precondition(raw[n], la.factor("A"), la.factor("G"), DAMPING)
        for n, la in precond.layers.items()
    }
    vg = sum((dense[n] * raw[n]).sum() for n in dense) * lr**2
    nu = min(1.0, float(torch.sqrt(kl_clip / vg.abs())))
    if kl_clip < 1:
        assert nu < 0.5  # the clip is really active in this case
    else:
        assert nu == 1.0
    for name, layer in precond.layers.items():
        assert rel_err(grad_matrix(layer.adapter.module), nu * dense[name]) <= TOL


@pytest.mark.parametrize("inner", [0.0, 1e-12, 3.7, -2.5, 1e30, float("inf"), float("nan")])
def test_kl_scale_read_on_cpu_is_the_tensor_rule(inner: float) -> None:
    # the CPU path forms nu from Python numbers; it must be the tensor rule exactly
    from kaisa.core.kl_clip import kl_scale, kl_scale_value

    for lr, clip in [(0.3, 1e-3), (1.0, 1e6)]:
        value = kl_scale_value(inner, lr, clip)
        tensor = float(kl_scale(torch.tensor(inner, dtype=torch.float64), lr, clip))
        if tensor != tensor:
            assert value != value  # NaN stays NaN
        else:
            assert value == pytest.approx(tensor, rel=1e-15, abs=0.0)


def _factors_after_one_step(model, loss_fn, batches, **kwargs):
    precond = KFACPreconditioner(model, **kfac_pytorch(damping=DAMPING, kl_clip=None, **kwargs))
    model.zero_grad()
    for xb in batches:
        loss_fn(model(xb), xb).backward()
    precond.step()
    return precond


def test_factors_do_not_depend_on_batch_size() -> None:
    # Duplicating every example changes N but not the Fisher of the mean loss.
    x, y = data(8)
    model = mlp()
    targets = {id(x): y}
    big_x = torch.cat([x, x])
    targets[id(big_x)] = torch.cat([y, y])
    loss = lambda out, xb: F.cross_entropy(out, targets[id(xb)])  # noqa: E731
    small = _factors_after_one_step(copy.deepcopy(model), loss, [x])
    big = _factors_after_one_step(copy.deepcopy(model), loss, [big_x])
    for name in small.layers:
        assert rel_err(big.layers[name].factor("A"), small.layers[name].factor("A")) <= TOL
        assert rel_err(big.layers[name].factor("G"), small.layers[name].factor("G")) <= TOL


@pytest.mark.parametrize("in_hook", [True, False])
def test_gradient_accumulation_equals_one_big_batch(in_hook: bool) -> None:
    x, y = data(12)
    model = mlp()
    parts = list(x.chunk(3))
    part_targets = {id(p): t for p, t in zip(parts, y.chunk(3))}
    part_targets[id(x)] = y
    acc = KFACPreconditioner(
        copy.deepcopy(model),
        **kfac_pytorch(
            damping=DAMPING,
            kl_clip=None,
            accumulation_steps=3,
            update_factors_in_hook=in_hook,
        ),
    )
    acc.model.zero_grad()
    for p in parts:
        (F.cross_entropy(acc.model(p), part_targets[id(p)]) / 3).backward()
    acc.step()
    one = _factors_after_one_step(
        copy.deepcopy(model), lambda out, xb: F.cross_entropy(out, part_targets[id(xb)]), [x]
    )
    for name in one.layers:
        assert rel_err(acc.layers[name].factor("A"), one.layers[name].factor("A")) <= TOL
        assert rel_err(acc.layers[name].factor("G"), one.layers[name].factor("G")) <= TOL
        assert (
            rel_err(
                grad_matrix(acc.layers[name].adapter.module),
                grad_matrix(one.layers[name].adapter.module),
            )
            <= TOL
        )


@pytest.mark.parametrize("in_hook", [True, False])
def test_a_short_last_step_set_between_steps_equals_its_one_big_batch(in_hook: bool) -> None:
    """An epoch of 5 micro-batches at 2 per step ends with a step of one,
    whose loss a Trainer divides by 1: ``precond.accumulation_steps = 1``
    before it (and 2 again after) keeps G that of each step's whole batch.
    The running averages and the weights equal those of one big batch per
    step; without the setting that short step's G was 4 times too large."""
    x, y = data(20)
    steps = [(x[0:8], y[0:8]), (x[8:16], y[8:16]), (x[16:20], y[16:20])]
    model = mlp()
    options = kfac_pytorch(damping=DAMPING, kl_clip=None, update_factors_in_hook=in_hook)
    acc_model, one_model = copy.deepcopy(model), copy.deepcopy(model)
    acc_opt = torch.optim.SGD(acc_model.parameters(), lr=0.1)
    one_opt = torch.optim.SGD(one_model.parameters(), lr=0.1)
    acc = KFACPreconditioner(acc_model, optimizer=acc_opt, accumulation_steps=2, **options)
    one = KFACPreconditioner(one_model, optimizer=one_opt, **options)
    for xs, ys in steps:
        micro = list(zip(xs.split(4), ys.split(4)))
        acc.accumulation_steps = len(micro)
        acc_opt.zero_grad()
        for xb, yb in micro:
            (F.cross_entropy(acc_model(xb), yb) / len(micro)).backward()
        acc.step()
        acc_opt.step()
        one_opt.zero_grad()
        F.cross_entropy(one_model(xs), ys).backward()
        one.step()
        one_opt.step()
    assert acc.accumulation_steps == 1 and acc.config.accumulation_steps == 1
    for name in one.layers:
        for f in ("A", "G"):
            assert rel_err(acc.layers[name].factor(f), one.layers[name].factor(f)) <= TOL
    for a, b in zip(acc_model.parameters(), one_model.parameters()):
        assert rel_err(a, b) <= TOL


@pytest.mark.parametrize("in_hook", [True, False])
def test_accumulation_steps_is_set_between_steps_only(in_hook: bool) -> None:
    x, y = data(8)
    model = mlp()
    precond = KFACPreconditioner(model, accumulation_steps=2, update_factors_in_hook=in_hook)
    for bad, error in ((0, ValueError), (1.5, TypeError), ("2", TypeError)):
        with pytest.raises(error, match="accumulation_steps"):
            precond.accumulation_steps = bad
    (F.cross_entropy(model(x[:4]), y[:4]) / 2).backward()
    with pytest.raises(RuntimeError, match="between steps only"):
        precond.accumulation_steps = 1
    assert precond.accumulation_steps == 2


def _views_step(
    accumulation_steps: int, in_hook: bool, loss_average: str = "batch"
) -> KFACPreconditioner:
    """Two forwards (two views of a batch) feeding one loss averaged over both."""
    x, y = data(12)
    precond = KFACPreconditioner(
        mlp(),
        **kfac_pytorch(damping=DAMPING, kl_clip=None, accumulation_steps=accumulation_steps),
        loss_average=loss_average,
        update_factors_in_hook=in_hook,
    )
    model = precond.model
    out = torch.cat([model(x[:6]), model(x[6:])])
    loss = F.cross_entropy(out, y, reduction="sum" if loss_average == "sum" else "mean")
    loss.backward()
    precond.step()
    return precond


@pytest.mark.parametrize("in_hook", [True, False], ids=["in_hook", "deferred"])
def test_forwards_feeding_one_averaged_loss_are_warned_about_and_read_right_as_micro_batches(
    in_hook: bool,
) -> None:
    """Each forward is read as a micro-batch: with two views in one mean loss
    and accumulation_steps=1, G would be (2/1)² too small, so kaisa says so
    once, naming the value that makes it right; with it, the factors are
    those of the concatenated batch."""
    x, y = data(12)
    whole = _factors_after_one_step(mlp(), lambda out, xb: F.cross_entropy(out, y), [x])
    with pytest.warns(UserWarning, match="2 training passes .* accumulation_steps=2"):
        short = _views_step(1, in_hook)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        right = _views_step(2, in_hook)
        _views_step(1, in_hook, "sum")  # a summed loss is read unscaled: nothing to say
    for name in whole.layers:
        expected = whole.layers[name].factor("G")
        assert rel_err(right.layers[name].factor("G"), expected) <= TOL
        assert rel_err(right.layers[name].factor("A"), whole.layers[name].factor("A")) <= TOL
        assert rel_err(4 * short.layers[name].factor("G"), expected) <= TOL  # (2/1)² too small


def test_module_called_twice_accumulates_both_calls() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    head = nn.Linear(4, 2)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.head = shared, head

        def forward(self, x):
            return self.head(self.shared(torch.tanh(self.shared(x))))

    model = Twice()
    x = torch.randn(6, 4)
    y = torch.randint(0, 2, (6,))
    precond, raw = kfac_step(model, lambda out: F.cross_entropy(out, y), x)
    # reference: both calls' rows; per-example output grads of each call
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = shared.register_forward_hook(lambda m, i, o: calls.append((i[0].detach(), o)))
    total = F.cross_entropy(model(x), y, reduction="sum")
    handle.remove()
    zgrads = torch.autograd.grad(total, [o for _, o in calls])
    A = outer_mean(with_ones(torch.cat([i for i, _ in calls])))
    rows = torch.cat(zgrads)
    G = rows.t() @ rows / 6
    layer = precond.layers["shared"]
    assert rel_err(layer.factor("A"), A) <= TOL
    assert rel_err(layer.factor("G"), G) <= TOL
    assert rel_err(grad_matrix(shared), dense_precondition(raw["shared"], A, G, DAMPING)) <= TOL


class _Stepped(nn.Module):
    """An RNN cell over sequences of lengths 4, 3, 2, 1 that steps only the
    rows still running (what ``pack_padded_sequence`` loops do), or one
    module called on the whole batch and on a part of it, in either order."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.cell = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "rnn":
            h = torch.zeros_like(x)
            for running in (4, 3, 2, 1):
                h = torch.cat([torch.tanh(self.cell(x[:running] + h[:running])), h[running:]])
            return self.head(h)
        if self.how == "whole-first":
            whole = torch.tanh(self.cell(x))
            part = torch.tanh(self.cell(x[:2]))
        else:
            part = torch.tanh(self.cell(x[:2]))
            whole = torch.tanh(self.cell(x))
        return self.head(whole + F.pad(part, (0, 0, 0, 2)))


@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("how", ["rnn", "whole-first", "part-first"])
def test_calls_on_parts_of_the_batch_take_the_whole_batch(how: str, in_hook: bool) -> None:
    """Every call of one pass is read with the pass's data points N (its
    widest call's batch): G took each call's own batch as the multiplier and
    the first-arriving gradient's as the normaliser, so it depended on the
    order of the calls and was wrong for both."""
    model = _Stepped(how)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 2, (4,), generator=torch.Generator().manual_seed(2))
    precond, raw = kfac_step(
        model, lambda out: F.cross_entropy(out, y), x, update_factors_in_hook=in_hook
    )
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = model.cell.register_forward_hook(lambda m, i, o: calls.append((i[0].detach(), o)))
    total = F.cross_entropy(model(x), y, reduction="sum")
    handle.remove()
    rows = torch.cat(torch.autograd.grad(total, [o for _, o in calls]))
    A = outer_mean(with_ones(torch.cat([i for i, _ in calls])))
    G = rows.t() @ rows / 4
    layer = precond.layers["cell"]
    assert rel_err(layer.factor("A"), A) <= TOL
    assert rel_err(layer.factor("G"), G) <= TOL
    assert rel_err(grad_matrix(model.cell), dense_precondition(raw["cell"], A, G, DAMPING)) <= TOL


@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("how", ["root-not-called", "summed-loss", "reentrant-checkpoint"])
def test_micro_batches_of_different_sizes_keep_their_own_n(how: str, in_hook: bool) -> None:
    """A step of a 4-row and a 2-row micro-batch (an epoch's last, short one):
    each is read with its own N, and G is the mean over the 6 rows, whether
    the preconditioner's root is never called (a LightningModule's
    ``training_step`` calls ``self.net``), both forwards feed one summed loss,
    or reentrant checkpointing recomputes every forward during backward."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    holder = nn.Module()
    holder.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    root = holder if how == "root-not-called" else holder.net
    precond = KFACPreconditioner(
        root,
        **kfac_pytorch(
            damping=DAMPING, kl_clip=None, accumulation_steps=2, update_factors_in_hook=in_hook
        ),
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)) for n in (4, 2)
    ]
    if how == "summed-loss":
        sum(F.cross_entropy(holder.net(x), y) / 2 for x, y in batches).backward()
    for x, y in batches if how != "summed-loss" else ():
        if how == "reentrant-checkpoint":
            out = checkpoint(holder.net, x.requires_grad_(), use_reentrant=True)
        else:
            out = holder.net(x)
        (F.cross_entropy(out, y) / 2).backward()
    precond.step()
    with precond.paused():
        rows = torch.cat(
            [(torch.softmax(holder.net(x), 1) - F.one_hot(y, 2)).detach() for x, y in batches]
        )
    assert (
        rel_err(precond.layers["net.2" if root is holder else "2"].factor("G"), rows.t() @ rows / 6)
        <= TOL
    )


def test_running_average_initialised_from_first_batch() -> None:
    model = mlp()
    decay = 0.7
    precond = KFACPreconditioner(
        model, **kfac_pytorch(factor_decay=decay, damping=DAMPING, kl_clip=None)
    )
    batches = [data(10, seed=s) for s in (1, 2)]
    refs = []
    for xb, yb in batches:
        with precond.paused():  # the reference's own forward must not be captured
            refs.append(
                reference_factors(model, model[0], xb, lambda out, yb=yb: ce_per_example(out, yb))
            )
        model.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        precond.step()
    A = decay * refs[0][0] + (1 - decay) * refs[1][0]
    G = decay * refs[0][1] + (1 - decay) * refs[1][1]
    assert rel_err(precond.layers["0"].factor("A"), A) <= TOL
    assert rel_err(precond.layers["0"].factor("G"), G) <= TOL


@pytest.mark.parametrize(
    "variant",
    [
        dict(update_factors_in_hook=False),
        dict(compute_eigenvalue_outer_product=False),
        dict(factor_dtype=torch.float64, inv_dtype=torch.float64),
    ],
    ids=["deferred-capture", "no-outer-product", "explicit-dtypes"],
)
def test_options_do_not_change_the_result(variant: dict) -> None:
    x, y = data()
    base_model, other_model = mlp(), mlp()
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    kfac_step(base_model, loss, x)
    kfac_step(other_model, loss, x, **variant)
    for a, b in zip(base_model.parameters(), other_model.parameters()):
        assert rel_err(b.grad, a.grad) <= 1e-12


def test_float32_factors_with_float64_model_are_close_not_exact() -> None:
    x, y = data()
    m64, m32 = mlp(), mlp()
    loss = lambda out: F.cross_entropy(out, y)  # noqa: E731
    kfac_step(m64, loss, x)
    p32, _ = kfac_step(m32, loss, x, factor_dtype=torch.float32, inv_dtype=torch.float32)
    assert p32.layers["0"].factor("A").dtype == torch.float32
    for a, b in zip(m64.parameters(), m32.parameters()):
        assert 0 < rel_err(b.grad, a.grad) <= 1e-4


def test_items_loss_needs_loss_items() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    precond = KFACPreconditioner(model, **kfac_pytorch(loss_average="items"))
    with pytest.raises(RuntimeError, match=r"precond\.loss_items is not set"):
        model(torch.randn(5, 4)).sum().backward()
    for bad in (0, -2.0, True, float("inf"), float("nan"), "3", torch.tensor([1.0, 2.0])):
        with pytest.raises((ValueError, TypeError), match="loss_items must be"):
            precond.loss_items = bad
    precond.loss_items = torch.tensor(7)
    assert precond.loss_items == 7.0


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_sequence_linear_reduce(method: str) -> None:
    """K-FAC-reduce: A = 1/N Σ_n ā_n ā_nᵀ (ā the mean input over positions, ones
    column included), G = 1/N Σ_n (Σ_t ĝ)(Σ_t ĝ)ᵀ (Eschenhagen et al. 2023)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 5))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 4, generator=g)
    y = torch.randint(0, 5, (3, 7), generator=g)

    def per_example(out):
        return (
            F.cross_entropy(out.reshape(-1, 5), y.reshape(-1), reduction="none").view(3, 7).sum(1)
        )

    precond, raw = kfac_step(
        model,
        lambda out: per_example(out).mean(),
        x,
        kfac_approx="reduce",
        compute_method=method,
    )
    solve = dense_precondition if method == "eigen" else dense_precondition_pi
    for name, layer in precond.layers.items():
        module = layer.adapter.module
        inp, zg = per_example_output_grads(model, module, x, per_example)
        A = outer_mean(with_ones(inp.mean(1)))
        summed = zg.sum(1)
        G = summed.t() @ summed / 3
        assert rel_err(layer.factor("A"), A) <= TOL
        assert rel_err(layer.factor("G"), G) <= TOL
        assert rel_err(grad_matrix(module), solve(raw[name], A, G, DAMPING)) <= TOL
    # and it is not expand in disguise
    expand, _ = kfac_step(model, lambda out: per_example(out).mean(), x)
    assert rel_err(expand.layers["0"].factor("G"), precond.layers["0"].factor("G")) > 1e-2


def test_conv_reduce_averages_patches() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(3 * 25, 4))
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 2, 5, 5, generator=g), torch.randint(0, 4, (4,), generator=g)
    precond, raw = kfac_step(model, lambda out: F.cross_entropy(out, y), x, kfac_approx="reduce")
    patches = conv_patches(x, conv).view(4, 25, -1)
    A = outer_mean(with_ones(patches.mean(1)))
    _, zg = per_example_output_grads(model, conv, x, lambda out: ce_per_example(out, y))
    summed = zg.flatten(2).sum(2)
    G = summed.t() @ summed / 4
    layer = precond.layers["0"]
    assert rel_err(layer.factor("A"), A) <= TOL
    assert rel_err(layer.factor("G"), G) <= TOL
    assert rel_err(grad_matrix(conv), dense_precondition(raw["0"], A, G, DAMPING)) <= TOL


@pytest.mark.parametrize("width", [8, 255, 256, 257, 300, 577])
@pytest.mark.parametrize("rows", [0, 1, 7, 300, 1200])
@pytest.mark.parametrize("alpha", [1.0, 0.37])
def test_gram_by_blocks_is_the_gram(width: int, rows: int, alpha: float) -> None:
    from kaisa.core.statistics import BLOCKED_GRAM_MIN_WIDTH, gram

    x = torch.randn(rows, width, dtype=torch.float64)
    out = gram(x, alpha)
    expected = alpha * (x.t() @ x)
    assert out.shape == (width, width)
    assert (out - expected).abs().max() <= 1e-12 * max(1.0, float(expected.abs().max()))
    if width >= BLOCKED_GRAM_MIN_WIDTH and rows >= 2 * width:
        third = width // 3  # the blocks below the diagonal are those above, transposed
        assert torch.equal(out[third:, :third], out[:third, third:].t())
    # a column view of a wider tensor (strided rows) gives the same Gram
    wide = torch.randn(rows, width + 5, dtype=torch.float64)
    assert torch.allclose(
        gram(wide[:, 2 : 2 + width], alpha),
        alpha * wide[:, 2 : 2 + width].t() @ wide[:, 2 : 2 + width],
        rtol=1e-12,
        atol=1e-12,
    )


def test_identity_memo_follows_the_specs_object_and_stays_bounded() -> None:
    from kaisa.core.specs import kfac_factors
    from kaisa.methods.base import IdentityMemo

    calls = []
    memo = IdentityMemo(lambda f, flag: calls.append((f, flag)) or (len(f), flag))
    specs = kfac_factors(5, 3)
    assert memo(specs) == (2, False) and memo(specs) == (2, False) and len(calls) == 1
    assert memo(specs, True) == (2, True) and len(calls) == 2  # the flag is part of the key
    equal_but_new = kfac_factors(5, 3)  # equal specs, another tuple
    memo(equal_but_new)
    assert len(calls) == 3  # by identity, not equality
    memo.limit = 4
    for _ in range(10):
        memo(kfac_factors(2, 2))
    assert len(memo._seen) <= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_decompositions_read_the_lower_triangle_only(dtype: torch.dtype) -> None:
    # kaisa hands a factor to eigh and Cholesky without symmetrising it first
    # (kaisa.core.decompose): that is exact only because both read one triangle
    from kaisa.core.decompose import damped_inverse, symmetric_eigh

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 7, generator=g, dtype=torch.float64)
    factor = (x.t() @ x / 40).to(dtype)
    upper = torch.triu(torch.randn(7, 7, generator=g, dtype=torch.float64) * 100, 1).to(dtype)
    garbled = torch.tril(factor) + upper
    before = factor.clone()
    q, lam = symmetric_eigh(factor, dtype)
    q2, lam2 = symmetric_eigh(garbled, dtype)
    assert torch.equal(lam, lam2) and torch.equal(q, q2)
    inv = damped_inverse(factor, 0.1, dtype)
    assert torch.equal(inv, damped_inverse(garbled, 0.1, dtype))
    expected = torch.linalg.inv(factor.double() + 0.1 * torch.eye(7, dtype=torch.float64))
    tol = 1e-12 if dtype is torch.float64 else 1e-5
    assert float((inv.double() - expected).norm() / expected.norm()) <= tol
    assert torch.equal(factor, before)  # neither writes the running factor


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e30])
def test_a_non_finite_gram_shows_on_its_diagonal(bad: float) -> None:
    # kaisa checks a dense factor's finiteness on its diagonal only
    # (kaisa.core.statistics.factor_finite): any non-finite entry of a positive
    # combination of Grams comes with a non-finite diagonal entry (3e30
    # overflows when squared in float32)
    from kaisa.core.statistics import all_finite, factor_finite

    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        rows = torch.randn(6, 5, generator=g, dtype=torch.float32)
        other = torch.randn(4, 5, generator=g, dtype=torch.float32)
        rows[trial % 6, (trial * 7) % 5] = bad
        factor = 0.9 * (rows.t() @ rows) + 0.1 * (other.t() @ other)
        assert not bool(all_finite(factor))
        assert not bool(factor_finite(factor))
    clean = torch.randn(6, 5, generator=g, dtype=torch.float32)
    assert bool(factor_finite(clean.t() @ clean))
    diagonal = torch.ones(5, dtype=torch.float32)
    diagonal[3] = bad
    # a diagonal factor: every entry is read (3e30 is a finite entry there)
    assert bool(factor_finite(diagonal)) == (bad == 3e30)


@pytest.mark.parametrize(
    ("method", "outer", "at_next_step"),
    [
        ("eigen", True, False),
        ("inverse", True, False),
        ("eigen", False, True),
        ("ekfac", True, True),
    ],
)
def test_a_new_damping_reaches_each_method_when_the_docs_say(
    method: str, outer: bool, at_next_step: bool
) -> None:
    """getting-started's ``damping`` row: the damped inverses of the inverse
    method and of eigen with the outer product are formed at inverse updates;
    eigen without it and EKFAC damp at every step."""
    x, y = data(12)

    def run(change: bool) -> torch.Tensor:
        model = mlp()
        precond = KFACPreconditioner(
            model, damping=0.1, kl_clip=None, factor_update_steps=1, inv_update_steps=10,
            compute_method=method, compute_eigenvalue_outer_product=outer,
        )  # fmt: skip
        for step in range(2):
            if step == 1 and change:
                precond.damping = 1.0
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            precond.step()
        return grad_matrix(model[0]).clone()

    assert torch.equal(run(True), run(False)) is not at_next_step
