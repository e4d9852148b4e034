"""The reused product buffers (kaisa.core.workspace) and the write-then-rescale path.

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

import kaisa.core.workspace
from kaisa import KFACPreconditioner
from kaisa.planner.forecast import forecast, layer_costs

from kfac_reference import dense_precondition, dense_precondition_pi, grad_matrix, rel_err

TOL = 1e-8
DAMPING = 0.01


@pytest.fixture
def every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace for layers of any size."""
    monkeypatch.setattr(kaisa.core.workspace, "MIN_BYTES", 0)


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


def _training(
    steps: int, min_bytes: int, method: str, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor]:
    """Every step's preconditioned gradients, flat, then the parameters."""
    monkeypatch.setattr(kaisa.core.workspace, "MIN_BYTES", min_bytes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(160, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=1, inv_update_steps=2, compute_method=method
    )
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        x, y = torch.randn(32, 160, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        seen.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))  # type: ignore[union-attr]
        opt.step()
    assert (precond.memory_usage()["workspace"] > 0) == (min_bytes == 0)
    return [*seen, torch.cat([p.detach().reshape(-1) for p in model.parameters()])]


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_float32_training_is_unchanged_by_the_workspace(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    # the products write into buffers, and into the gradients themselves
    # (split at the bias column, so BLAS sums in another order; the eigen
    # method's ⟨V, ∇⟩ taken in the eigenbasis): float32 rounding on the first
    # step (measured 4e-7 to 6e-7 of the model's gradient), which later
    # decompositions of the factors at damping 0.001 amplify (to 2e-5)
    with_buffers = _training(4, 0, method, monkeypatch)
    without = _training(4, 2**62, method, monkeypatch)
    errors = [rel_err(a, b) for a, b in zip(with_buffers, without)]
    assert errors[0] <= 2e-6, errors
    assert max(errors) <= 1e-4, errors


@pytest.mark.usefixtures("float64_default", "every_layer")
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("kl_clip", [None, 1e-6])
def test_products_read_and_write_the_gradients_in_place(
    monkeypatch: pytest.MonkeyPatch, method: str, kl_clip: float | None
) -> None:
    # no [∇W | ∇b] is assembled (read_into is never called) and V lands in
    # the very tensors autograd wrote: .grad keeps its storage
    from kaisa.engines.pytorch import TorchEngine

    def no_matrix(*args: object) -> None:
        raise AssertionError("the gradient matrix was assembled")

    monkeypatch.setattr(TorchEngine, "read_into", no_matrix)
    model = net()
    precond = KFACPreconditioner(model, damping=DAMPING, compute_method=method, kl_clip=kl_clip)
    x, y = batch()
    F.cross_entropy(model(x), y).backward()
    storage = {n: p.grad.data_ptr() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    precond.step()
    assert {n: p.grad.data_ptr() for n, p in model.named_parameters()} == storage  # type: ignore[union-attr]


@pytest.mark.usefixtures("float64_default", "every_layer")
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_gradients_the_products_cannot_write_in_place_take_the_general_path(method: str) -> None:
    # a channels-last weight's gradient is not the [d_out, ·] matrix's
    # memory: it is assembled and V copied back, with the same result
    model = net().to(memory_format=torch.channels_last)
    precond, raw = one_step(model, compute_method=method, kl_clip=1e-6, lr=0.3)
    conv = model[0]
    assert not conv.weight.grad.is_contiguous()  # type: ignore[union-attr]
    assert precond.layers["0"].adapter.grad_blocks([conv.weight.grad, conv.bias.grad]) is None
    dense = dense_precondition if method == "eigen" else dense_precondition_pi
    expected = {
        n: dense(raw[n], la.factor("A"), la.factor("G"), DAMPING)
        for n, la in precond.layers.items()
    }
    vg = sum((expected[n] * raw[n]).sum() for n in expected) * 0.3**2
    nu = min(1.0, float(torch.sqrt(1e-6 / vg.abs())))
    for name, layer in precond.layers.items():
        assert rel_err(grad_matrix(layer.adapter.module), nu * expected[name]) <= TOL


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


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("kl_clip", [None, 1e-6])
def test_packed_projection_holds_v_while_the_other_layers_write_at_once(
    monkeypatch: pytest.MonkeyPatch, kl_clip: float | None
) -> None:
    # q, k and v own rows of one packed parameter: rescaling it after the
    # writes would scale the rows of layers that did not take part, so those
    # three hold V until ν is known; out_proj and the head own their
    # parameters and take the workspace path.  Same result as without any
    # workspace, and the forecast knows which layers the buffers serve.
    def run(min_bytes: int) -> tuple[KFACPreconditioner, list[torch.Tensor]]:
        monkeypatch.setattr(kaisa.core.workspace, "MIN_BYTES", min_bytes)
        torch.manual_seed(0)
        model = Attend()
        precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=kl_clip, lr=0.3)
        model(torch.randn(4, 5, 8)).square().sum().backward()
        precond.step()
        return precond, [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    precond, with_buffers = run(0)
    packed = [n for n, la in precond.layers.items() if any(la.adapter.param_rows())]
    assert len(packed) == 3
    own = [la for n, la in precond.layers.items() if n not in packed]
    largest = max(int(torch.Size(la.adapter.matrix_shape).numel()) for la in own)
    assert precond.memory_usage()["workspace"] == 3 * 8 * largest
    model = Attend()
    assert int(forecast(layer_costs(model), 1).memory["workspace"][0]) == 3 * 8 * largest
    _, without = run(2**62)
    for a, b in zip(with_buffers, without):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("widths", [(7,), (7, 1), (3, 5, 1)])
def test_products_of_column_blocks_equal_those_of_the_matrix(
    axis: int, widths: tuple[int, ...]
) -> None:
    from kaisa.core.kronecker import mul_axis, mul_axis_from, mul_axis_to

    g = torch.Generator().manual_seed(0)
    blocks = [torch.randn(5, w, generator=g) for w in widths]
    matrix = torch.cat(blocks, dim=1)
    m = torch.randn(matrix.shape[axis], matrix.shape[axis], generator=g)
    expected = mul_axis(matrix, m, axis)
    out = torch.full_like(matrix, float("nan"))
    assert mul_axis_from(blocks, m, axis, out) is out
    assert rel_err(out, expected) <= 1e-14
    written = [torch.full_like(b, float("nan")) for b in blocks]
    mul_axis_to(matrix, m, axis, written)
    assert rel_err(torch.cat(written, dim=1), expected) <= 1e-14


@pytest.mark.usefixtures("float64_default", "every_layer")
def test_eigen_kl_term_in_the_eigenbasis_is_that_of_v() -> None:
    # ⟨C / D, C⟩ with C = Q_Gᵀ ∇ Q_A equals ⟨V, ∇⟩: the bases are orthogonal
    from kaisa.core.kl_clip import kl_term
    from kaisa.core.workspace import Workspace
    from kaisa.methods import EigenMethod

    model = net()
    precond, raw = one_step(model, compute_method="eigen", kl_clip=None)
    layer = precond.layers["3"]  # Linear(108, 6) with a bias
    method = EigenMethod()
    grad = raw["3"]
    v = method.apply(layer, grad, DAMPING)
    blocks = [grad[:, :-1].clone(), grad[:, -1:].clone()]
    work = Workspace(grad.numel(), grad.device)
    dot = method.apply_blocks(layer, blocks, DAMPING, work, blocks, True)
    assert dot is not None
    assert abs(float(dot) - float(kl_term(v, grad))) <= 1e-12 * abs(float(dot))
    assert rel_err(torch.cat(blocks, dim=1), v) <= 1e-12


def test_kept_gradients_are_copies_side_by_side() -> None:
    from kaisa.core.workspace import Workspace

    work = Workspace(12, torch.device("cpu"))
    blocks = [torch.arange(8.0).view(4, 2), torch.arange(4.0).view(4, 1) + 100]
    kept = work.keep(blocks)
    blocks[0].zero_()
    assert torch.equal(kept[0], torch.arange(8.0).view(4, 2))
    assert torch.equal(kept[1], torch.arange(4.0).view(4, 1) + 100)
    assert kept[1].data_ptr() == kept[0].data_ptr() + 8 * 4  # one buffer, in turn


def test_sole_owners_excludes_shared_rows_and_tied_weights() -> None:
    from kaisa.layers.attention import ProjectionAdapter
    from kaisa.layers.base import sole_owners
    from kaisa.layers.linear import LinearAdapter

    attn = nn.MultiheadAttention(8, 2)
    first, second, alone = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
    second.weight = first.weight  # tied: whoever writes first, the other reads V
    adapters = [
        *(ProjectionAdapter(f"attn.{r}", attn, r) for r in ("q", "k", "v")),
        LinearAdapter("first", first),
        LinearAdapter("second", second),
        LinearAdapter("alone", alone),
    ]
    assert sole_owners(adapters) == [False, False, False, False, False, True]
    assert sole_owners(adapters[3:4]) == [True]  # alone among the registered, it owns it
