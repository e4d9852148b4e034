"""A frozen bias is not part of its layer's K-FAC block.

K-FAC preconditions the parameters that are trained: a layer whose bias does
not require grad has the block ``G ⊗ A`` of its weight alone (A without the
ones column), its bias never gets a gradient and the optimizer never moves
it.  The block is fixed when the preconditioner is built; a bias frozen or
unfrozen later is warned about, and a bias frozen later still gets no
gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from kfac_reference import (
    conv_patches,
    dense_precondition,
    dense_precondition_pi,
    outer_mean,
    per_example_output_grads,
    rel_err,
)

TOL = 1e-8
DAMPING = 0.01

pytestmark = pytest.mark.usefixtures("float64_default")


def _model(kind: str) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    if kind == "linear":
        first = nn.Linear(5, 4)
        model = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 3))
        x = torch.randn(7, 5, generator=g)
    else:
        first = nn.Conv2d(2, 3, 3, padding=1)
        model = nn.Sequential(first, nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 3))
        x = torch.randn(7, 2, 4, 4, generator=g)
    return model, first, x, torch.randint(0, 3, (7,), generator=g)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_a_frozen_bias_leaves_the_weights_own_block(kind: str, method: str) -> None:
    model, first, x, y = _model(kind)
    first.bias.requires_grad_(False)
    frozen = first.bias.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, damping=DAMPING, kl_clip=None, compute_method=method
    )
    layer = precond.layers["0"]
    F.cross_entropy(model(x), y).backward()
    raw = first.weight.grad.reshape(first.weight.shape[0], -1).clone()
    precond.step()
    assert first.bias.grad is None  # no gradient for a parameter that is not trained

    inputs, zg = per_example_output_grads(
        model, first, x, lambda out: F.cross_entropy(out, y, reduction="none")
    )
    if kind == "linear":
        rows, g_rows = inputs, zg
    else:
        rows, g_rows = conv_patches(inputs, first), zg.permute(0, 2, 3, 1).reshape(-1, 3)
    A = outer_mean(rows)  # no ones column: the bias is not in the block
    G = g_rows.t() @ g_rows / 7
    assert rel_err(layer.factor("A"), A) <= TOL and rel_err(layer.factor("G"), G) <= TOL
    got = first.weight.grad.reshape(first.weight.shape[0], -1)
    solve = dense_precondition if method == "eigen" else dense_precondition_pi
    assert rel_err(got, solve(raw, A, G, DAMPING)) <= TOL
    opt.step()
    assert torch.equal(first.bias, frozen)  # the optimizer never moved it
    assert "0.bias" not in str(precond.describe())


def test_a_frozen_attention_bias_gets_no_gradient() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    mha.in_proj_bias.requires_grad_(False)
    precond = KFACPreconditioner(mha, damping=DAMPING, kl_clip=None)
    x = torch.randn(3, 4, 8)
    mha(x, x, x)[0].pow(2).mean().backward()
    precond.step()
    assert mha.in_proj_bias.grad is None
    assert mha.out_proj.bias.grad is not None  # a trained bias is preconditioned as before
    assert all(not la.adapter.has_bias for name, la in precond.layers.items() if "out" not in name)


def _steps(model: nn.Module, precond: KFACPreconditioner, opt, x, y, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()


def test_a_bias_frozen_after_the_build_gets_no_gradient_and_is_warned_about() -> None:
    model, first, x, y = _model("linear")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, factor_update_steps=1)
    _steps(model, precond, opt, x, y, 2)
    first.bias.requires_grad_(False)
    opt.zero_grad(set_to_none=True)
    frozen = first.bias.detach().clone()
    with pytest.warns(UserWarning, match="bias of layer '0' was trained when .* frozen now"):
        _steps(model, precond, opt, x, y, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        _steps(model, precond, opt, x, y, 2)
    assert first.bias.grad is None and torch.equal(first.bias, frozen)


def test_a_bias_unfrozen_after_the_build_keeps_its_raw_gradient() -> None:
    model, first, x, y = _model("linear")
    first.bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, factor_update_steps=1)
    _steps(model, precond, opt, x, y, 1)
    first.bias.requires_grad_(True)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = first.bias.grad.clone()
    with pytest.warns(UserWarning, match="bias of layer '0' was frozen when .* requires grad now"):
        precond.step()
    assert torch.equal(first.bias.grad, raw)


def test_a_bias_training_under_a_frozen_weight_keeps_its_raw_gradient_and_is_told() -> None:
    """BitFit: the weight frozen, the bias trained.  The layer is
    preconditioned on the steps its weight has a gradient, so the bias keeps
    its raw gradient; that was silent while describe() listed the layer."""
    model, first, x, y = _model("linear")
    model = nn.Sequential(*model[:2], nn.Linear(4, 4), nn.Tanh(), model[2])
    for layer in (first, model[2]):  # two such layers: one warning names both
        layer.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, factor_update_steps=1)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = first.bias.grad.clone()
    with pytest.warns(UserWarning, match=r"weights are frozen: \['0', '2'\]") as told:
        precond.step()
    assert len([w for w in told if "weights are frozen" in str(w.message)]) == 1
    assert torch.equal(first.bias.grad, raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        _steps(model, precond, opt, x, y, 2)


def test_every_weight_frozen_at_the_start_steps_then_unfreezes() -> None:
    """Gradual unfreezing from a model whose registered weights are all frozen
    (only biases, or layers kaisa does not register, train at first): the
    first steps have nothing to precondition and were refused as 'no
    forward/backward captured'; they pass, and a weight unfrozen later is
    preconditioned from its next factor step."""
    model, first, x, y = _model("linear")
    for layer in (first, model[2]):
        layer.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, damping=DAMPING, factor_update_steps=1)
    with pytest.warns(UserWarning, match="weights are frozen"):
        _steps(model, precond, opt, x, y, 2)
    assert not any(la.captured for la in precond.layers.values())
    model[2].weight.requires_grad_(True)
    opt.add_param_group({"params": [model[2].weight]})
    _steps(model, precond, opt, x, y, 1)
    assert precond.layers["2"].captured and not precond.layers["0"].captured
