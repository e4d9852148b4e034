"""The reused product buffers (kaisa.workspace) and the write-then-rescale path.

On CPU, every rank being every layer's gradient worker, each layer's ``V`` is
written into ``.grad`` at once and the KL clip's ``ν`` rescales all of them
afterwards; the products of layers whose gradient matrix is at least
``MIN_BYTES`` reuse three shared buffers.  Checked here against the dense
float64 reference (the workspace forced onto small layers, so that
``torch.kron`` stays small), against the path without a workspace, for the
memory it reports and the forecast predicts, and for the models it must stay
away from (the packed q/k/v projection of an attention layer).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa.workspace
from kaisa import KFACPreconditioner
from kaisa.forecast import forecast, layer_costs

from kfac_reference import dense_precondition, dense_precondition_pi, grad_matrix, rel_err

TOL = 1e-8
DAMPING = 0.01


@pytest.fixture
def every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace for layers of any size."""
    monkeypatch.setattr(kaisa.workspace, "MIN_BYTES", 0)


def net(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, bias=bias)
    return nn.Sequential(
        conv, nn.Tanh(), nn.Flatten(), nn.Linear(3 * 36, 6, bias=bias), nn.Tanh(), nn.Linear(6, 4)
    )


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 2, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)


def one_step(
    model: nn.Module, x: torch.Tensor | None = None, **kwargs: object
) -> tuple[KFACPreconditioner, dict]:
    kwargs.setdefault("damping", DAMPING)
    precond = KFACPreconditioner(model, **kwargs)  # type: ignore[arg-type]
    x, y = batch() if x is None else (x, torch.arange(len(x)) % 4)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raw = {n: grad_matrix(la.adapter.module).clone() for n, la in precond.layers.items()}
    precond.step()
    return precond, raw


@pytest.mark.usefixtures("float64_default", "every_layer")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [None, 1e-6])
def test_reused_buffers_give_the_dense_result(
    bias: bool, method: str, kl_clip: float | None
) -> None:
    lr = 0.3
    precond, raw = one_step(net(bias), compute_method=method, kl_clip=kl_clip, lr=lr)
    assert precond.memory_usage()["workspace"] > 0  # the buffers were really used
    dense = dense_precondition if method == "eigen" else dense_precondition_pi
    expected = {
        n: dense(raw[n], la.factor("A"), la.factor("G"), DAMPING)
        for n, la in precond.layers.items()
    }
    nu = 1.0
    if kl_clip is not None:
        vg = sum((expected[n] * raw[n]).sum() for n in expected) * lr**2
        nu = min(1.0, float(torch.sqrt(kl_clip / vg.abs())))
        assert nu < 0.5  # the clip is active
    for name, layer in precond.layers.items():
        assert rel_err(grad_matrix(layer.adapter.module), nu * expected[name]) <= TOL


def _grads_after(steps: int, min_bytes: int, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    monkeypatch.setattr(kaisa.workspace, "MIN_BYTES", min_bytes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(160, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=opt, factor_update_steps=1, inv_update_steps=2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(32, 160, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()
    assert (precond.memory_usage()["workspace"] > 0) == (min_bytes == 0)
    return [p.detach().clone() for p in model.parameters()]


def test_float32_training_is_unchanged_by_the_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    # the products write into buffers instead of fresh tensors: same kernels,
    # same values, bit for bit
    with_buffers = _grads_after(4, 0, monkeypatch)
    without = _grads_after(4, 2**62, monkeypatch)
    for a, b in zip(with_buffers, without):
        assert torch.equal(a, b)


def test_default_threshold_serves_large_layers_only() -> None:
    torch.manual_seed(0)
    big, small = nn.Linear(300, 200), nn.Linear(200, 10)  # 200 x 301 fp32: 235 KiB
    model = nn.Sequential(big, nn.ReLU(), small)
    precond, _ = one_step(model, torch.randn(16, 300), kl_clip=0.001)
    assert precond.memory_usage()["workspace"] == 3 * 4 * 200 * 301
    predicted = forecast(layer_costs(model), 1)
    assert int(predicted.memory["workspace"][0]) == 3 * 4 * 200 * 301
    assert int(predicted.memory["total"][0]) == precond.memory_usage()["total"]


def test_no_workspace_for_small_layers() -> None:
    precond, _ = one_step(net())
    assert precond.memory_usage()["workspace"] == 0
    assert int(forecast(layer_costs(net()), 1).memory["workspace"][0]) == 0


class Attend(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(1))


@pytest.mark.usefixtures("every_layer")
def test_packed_projection_keeps_every_gradient_until_all_are_read() -> None:
    # q, k and v own rows of one packed parameter: rescaling it after the
    # writes would scale the rows of layers that did not take part, so the
    # rescale path (and with it the workspace) stays off; the forecast knows
    torch.manual_seed(0)
    model = Attend()
    precond = KFACPreconditioner(model, damping=DAMPING)
    model(torch.randn(4, 5, 8)).square().sum().backward()
    precond.step()
    assert any(r is not None for la in precond.layers.values() for r in la.adapter.param_rows())
    assert precond.memory_usage()["workspace"] == 0
    assert int(forecast(layer_costs(model), 1).memory["workspace"][0]) == 0
