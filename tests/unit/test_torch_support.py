"""Which torch releases kaisa supports (kaisa.torch_support).

1. A release is read as ``(major, minor)`` from any build's version string.
2. Below the compile floor a compiled model with K-FAC attached trains its
   forward and backward, and the next ``step()`` refuses with an error that
   names the floor and the installed torch, before any statistics are
   folded; ``precond.compile()`` refuses the same way.  The same model run
   eagerly steps as before.  (The installed torch is put below the floor
   here by patching the flag, so this runs on every torch; on a torch
   really below it, the same path is taken without the patch.)
   The refusal comes from both of the compiled capture's paths: a module's
   forward hook and ``nn.MultiheadAttention``'s own capture.
3. The README, pyproject and ``make test-torch`` state the floors the
   library enforces.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner, torch_support

KW = dict(factor_update_steps=1, inv_update_steps=1, damping=0.1, lr=0.1)
FLOOR = ".".join(map(str, torch_support.COMPILE_FLOOR))


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.4.1+cu121", (2, 4)), ("2.11.0a0+git1234abc", (2, 11)), ("2.13.0+cpu", (2, 13))],
)
def test_a_release_is_its_major_and_minor(version: str, expected: tuple[int, int]) -> None:
    assert torch_support.release(version) == expected


def test_a_version_that_is_not_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="not a torch version: 'nightly'"):
        torch_support.release("nightly")


class _Attention(nn.Module):
    """Only an ``nn.MultiheadAttention``: its projections are captured by
    kaisa's attention capture alone (no module hook sees them)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


def _model(kind: str = "mlp") -> nn.Module:
    torch.manual_seed(0)
    if kind == "attention":
        return _Attention()
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model: nn.Module) -> None:
    x = torch.randn(16, 5, 6, generator=torch.Generator().manual_seed(1))
    model(x).logsumexp(-1).mean().backward()


@pytest.fixture
def below_the_floor(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch_support, "COMPILE_SUPPORTED", False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("below_the_floor")
@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_below_the_floor_a_compiled_model_is_refused_at_its_first_step(kind: str) -> None:
    model = _model(kind)
    assert kind != "attention" or set(KFACPreconditioner(_model(kind), **KW).layers) == {
        "mha.q",
        "mha.k",
        "mha.v",
        "mha.out_proj",
    }
    precond = KFACPreconditioner(model, **KW)
    compiled = torch.compile(model, backend="eager")
    _backward(compiled)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError) as raised:
        precond.step()
    message = str(raised.value)
    assert f"needs torch >= {FLOOR}" in message
    assert torch.__version__ in message
    assert "a model compiled with torch.compile" in message
    # nothing was folded and no gradient was touched
    assert precond.steps == 0
    assert all(not layer.captured for layer in precond.layers.values())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.usefixtures("below_the_floor")
def test_below_the_floor_precond_compile_is_refused() -> None:
    precond = KFACPreconditioner(_model(), **KW)
    with pytest.raises(RuntimeError, match=rf"precond\.compile\(\) needs torch >= {FLOOR}"):
        precond.compile(backend="eager")


@pytest.mark.usefixtures("below_the_floor")
def test_below_the_floor_an_eager_model_steps_as_before() -> None:
    model = _model()
    precond = KFACPreconditioner(model, **KW)
    _backward(model)
    precond.step()
    assert precond.steps == 1
    assert all(layer.captured for layer in precond.layers.values())


def test_the_readme_pyproject_and_makefile_state_the_floors_the_library_enforces() -> None:
    root = Path(__file__).resolve().parents[2]
    eager = ".".join(map(str, torch_support.EAGER_FLOOR))
    readme = (root / "README.md").read_text()
    assert re.findall(r"`torch\.compile` needs torch ≥ (\d+\.\d+)", readme) == [FLOOR]
    assert re.findall(r"kaisa runs on torch (\d+\.\d+) and newer", readme) == [eager]
    assert re.findall(r'"torch>=([\d.]+)"', (root / "pyproject.toml").read_text()) == [eager]
    default = re.search(
        r'^TEST_TORCH \?= "torch==(\d+\.\d+)\.', (root / "Makefile").read_text(), re.M
    )
    assert default is not None and default.group(1) == eager
