"""Conv1d and Hugging Face's Conv1D against dense float64 definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from kfac_reference import (
    dense_precondition,
    grad_matrix,
    outer_mean,
    per_example_output_grads,
    rel_err,
    with_ones,
)

TOL = 1e-8
DAMPING = 0.01


@pytest.fixture(autouse=True)
def _float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


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

    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None)
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

    precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None)
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
