"""``optimizer=`` as the list of optimizers that step the model.

torch's Muon takes the hidden weight matrices only; an AdamW steps the
embeddings, the head and the biases. A step skipped for non-finite gradients
must change none of them, the KL clip reads the first optimizer's lr, a
GradScaler must have unscaled every one, and an optimizer= that leaves
trainable parameters out is warned about by name.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from skip_case import assert_same_run, run_with_a_nan_step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(10, 6), nn.Flatten(), nn.Linear(24, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 10, (16, 4), generator=g), torch.randint(0, 3, (16,), generator=g)


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Muon's hidden matrix (the first Linear's weight) and everything else."""
    hidden = [model[2].weight]
    return hidden, [p for p in model.parameters() if all(p is not h for h in hidden)]


def _optimizers(model: nn.Module, muon: bool) -> list[torch.optim.Optimizer]:
    hidden, rest = _split(model)
    first: torch.optim.Optimizer = (
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1)
        if muon
        else torch.optim.SGD(hidden, lr=0.1, momentum=0.9)
    )
    return [first, torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1)]


@pytest.mark.parametrize(
    "muon",
    [False, pytest.param(True, marks=pytest.mark.needs_torch((2, 9), "torch.optim.Muon"))],
    ids=["sgd+adamw", "muon+adamw"],
)
def test_a_skipped_step_changes_nothing_any_optimizer_given_holds(muon: bool) -> None:
    def make(model: nn.Module) -> list[torch.optim.Optimizer]:
        return _optimizers(model, muon)

    kaisa_skips = run_with_a_nan_step(make, False, _model, _batch)
    loop_skips = run_with_a_nan_step(make, True, _model, _batch)
    assert_same_run(kaisa_skips, loop_skips)


def test_an_optimizer_that_leaves_trainable_parameters_out_is_named() -> None:
    model = _model()
    first, second = _optimizers(model, muon=False)
    with pytest.warns(UserWarning, match=r"holds none of 0\.weight, 2\.bias, 4\.weight, 4\.bias"):
        KFACPreconditioner(model, optimizer=first)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(model, optimizer=[first, second])
        # frozen parameters need no optimizer
        for p in _split(model)[1]:
            p.requires_grad_(False)
        KFACPreconditioner(model, optimizer=first)
        # an optimizer holding views of the parameters (a 2-D view for Muon,
        # as optimizer wrappers build) holds them
        for p in model.parameters():
            p.requires_grad_(True)
        views = [p.detach().view(p.shape[0], -1) for p in model.parameters()]
        KFACPreconditioner(model, optimizer=torch.optim.SGD(views, lr=0.1))


def test_the_kl_clip_reads_the_first_optimizers_lr_at_every_step() -> None:
    model = _model()
    first, second = _optimizers(model, muon=False)
    precond = KFACPreconditioner(model, optimizer=[first, second])
    assert precond.lr == 0.1
    first.param_groups[0]["lr"] = 0.05
    assert precond.lr == 0.05
    second.param_groups[0]["lr"] = 0.5
    assert precond.lr == 0.05


@pytest.mark.parametrize(
    "value, words",
    [
        ([], "it is empty"),
        ([1], "it holds int"),
        ("adamw", "got str"),
    ],
)
def test_optimizer_must_be_an_optimizer_or_a_list_of_them(value: object, words: str) -> None:
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, a list"):
        KFACPreconditioner(_model(), optimizer=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=words):
        KFACPreconditioner(_model(), optimizer=value)  # type: ignore[arg-type]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="names an optimizer twice"):
        KFACPreconditioner(model, optimizer=[opt, opt])
    with pytest.raises(TypeError, match=r"pass the optimizer as optimizer="):
        KFACPreconditioner(model, [opt])  # type: ignore[misc]


def test_a_grad_scaler_must_have_unscaled_every_optimizer() -> None:
    model = _model()
    first, second = _optimizers(model, muon=False)
    scaler = torch.amp.GradScaler("cpu")
    precond = KFACPreconditioner(model, optimizer=[first, second], grad_scaler=scaler)
    x, y = _batch(0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.unscale_(first)
    with pytest.raises(RuntimeError, match=r"unscale_\(optimizer\) \(for each optimizer given\)"):
        precond.step()
    scaler.unscale_(second)
    assert precond.step() is True


def test_every_fused_optimizer_given_is_handed_the_verdict_while_attached() -> None:
    model = _model()
    hidden, rest = _split(model)
    fused = [
        torch.optim.SGD(hidden, lr=0.1, momentum=0.9, fused=True),
        torch.optim.AdamW(rest, lr=0.01, fused=True),
    ]
    precond = KFACPreconditioner(model, optimizer=fused)
    flags = [opt.found_inf for opt in fused]  # type: ignore[attr-defined]
    assert all(isinstance(f, torch.Tensor) for f in flags)
    precond.remove_hooks()
    assert not any(hasattr(opt, "found_inf") for opt in fused)


def test_the_skip_report_speaks_of_every_optimizer() -> None:
    model = _model()
    opts = _optimizers(model, muon=False)
    precond = KFACPreconditioner(model, optimizer=opts)
    x, y = _batch(0)
    (F.cross_entropy(model(x), y) * float("nan")).backward()
    with pytest.warns(UserWarning, match="the optimizers' parameters was taken away") as caught:
        assert precond.step() is False
    assert "their next steps change no weight" in str(caught[0].message)
    assert all(p.grad is None for p in model.parameters())
