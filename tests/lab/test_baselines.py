"""Today's baselines in ``kaisa``: Muon (+AdamW), SOAP, Shampoo, LAMB, and ``--optimizers``."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kaisa_lab.cli.main import build_parser, main
from kaisa_lab.cli.spec import build_specs
from kaisa_lab.optim import (
    BASELINE_LR,
    KFAC_BASES,
    MuonWithAdamW,
    OptionalDependencyError,
    build_optimizer,
    muon_split,
)
from kaisa_lab.optim import build as optim_build
from kaisa_lab.tasks import get_task, task_names

from fakes import write_fake_cifar

NEW = ("muon", "soap", "shampoo", "lamb")
EXTERNAL = {"soap": "heavyball", "shampoo": "heavyball", "lamb": "pytorch_optimizer"}


def _needs_package(name: str) -> None:
    if name in EXTERNAL:
        pytest.importorskip(EXTERNAL[name])


# ---------------------------------------------------------------- the Muon split


def test_muon_split_of_the_transformer_is_the_documented_one() -> None:
    split = muon_split(get_task("text-lm").build_model())
    hidden = ("self_attn.in_proj_weight", "self_attn.out_proj.weight", "linear1.weight")
    assert split.head == "head"
    assert split.muon == tuple(
        f"blocks.{b}.{name}" for b in range(2) for name in (*hidden, "linear2.weight")
    )
    per_block = [
        "self_attn.in_proj_bias", "self_attn.out_proj.bias", "linear1.bias", "linear2.bias",
        "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
    ]  # fmt: skip
    assert split.adamw == (
        "tok.weight",
        "pos.weight",
        *(f"blocks.{b}.{name}" for b in range(2) for name in per_block),
        "ln_f.weight",
        "ln_f.bias",
        "head.weight",
        "head.bias",
    )


def test_muon_split_of_the_cnn_puts_every_filter_on_muon_and_the_rest_on_adamw() -> None:
    model = get_task("digits-cnn").build_model()
    split = muon_split(model)
    params = dict(model.named_parameters())
    convs = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert set(split.muon) == convs and all(params[n].dim() == 4 for n in convs)
    assert split.head == "fc" and {"fc.weight", "fc.bias"} <= set(split.adamw)
    assert all(params[n].dim() == 1 for n in split.adamw if not n.startswith("fc."))
    assert sorted(split.muon + split.adamw) == sorted(params)


@pytest.mark.parametrize("task", task_names())
def test_the_default_head_is_the_layer_that_produces_the_output(task: str) -> None:
    model = get_task(task).build_model()
    head = dict(model.named_modules())[muon_split(model).head]
    seen: list[torch.Tensor] = []
    head.register_forward_hook(lambda _m, _i, out: seen.append(out))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    x = {"text-lm": tokens, "text-cnn": tokens, "text-lm-large": tokens,
         "cifar10": torch.randn(2, 3, 32, 32), "digits-cnn": torch.randn(2, 1, 8, 8)}.get(
        task, torch.randn(2, 64))  # fmt: skip
    out = model(x)
    assert len(seen) == 1 and seen[0].data_ptr() == out.data_ptr()


def test_muon_steps_a_conv_filter_as_torch_muon_steps_its_flattened_matrix() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = nn.Parameter(reference["0.weight"].reshape(4, -1).clone())
    ref_muon = torch.optim.Muon([flat], lr=0.05, weight_decay=0.1)
    rest = [nn.Parameter(reference[n].clone()) for n in ("0.bias", "2.weight", "2.bias")]
    ref_adamw = torch.optim.AdamW(rest, lr=0.01, weight_decay=0.2)
    opt = MuonWithAdamW(model, lr=0.05, weight_decay=0.1, adamw_lr=0.01, adamw_weight_decay=0.2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 2, 6, 6)).square().sum().backward()
        grads = dict(model.named_parameters())
        flat.grad = grads["0.weight"].grad.reshape(4, -1).clone()
        for p, n in zip(rest, ("0.bias", "2.weight", "2.bias")):
            p.grad = grads[n].grad.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
        assert torch.equal(model[0].weight.reshape(4, -1), flat)
        for p, n in zip(rest, ("0.bias", "2.weight", "2.bias")):
            assert torch.equal(grads[n], p)
    assert not torch.equal(model[0].weight, reference["0.weight"])
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[1]["lr"] == 0.01


def test_muon_newton_schulz_iterations_reach_torch_muon_and_the_record() -> None:
    """``muon_ns_steps`` is torch Muon's ``ns_steps``; a run's record names it
    only where it differs from torch's default, so earlier records still
    describe the same runs."""
    from kaisa_lab.bench.cases import get_case
    from kaisa_lab.cli.trainer import make_optimizer

    case = get_case("text-lm")
    arm = case.arm("muon+kfac")
    spec = case.spec(arm, case.grid(arm)[0], 0)
    model = get_task("text-lm").build_model()
    assert make_optimizer(spec, model).param_groups[0]["ns_steps"] == 5
    assert "muon_ns_steps" not in spec.to_dict()
    fewer = dataclasses.replace(spec, muon_ns_steps=2)
    assert make_optimizer(fewer, model).param_groups[0]["ns_steps"] == 2
    assert fewer.to_dict()["muon_ns_steps"] == 2


def test_muon_zero_grad_clears_the_filters_gradients() -> None:
    model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.Flatten(), nn.Linear(3, 1))
    opt = MuonWithAdamW(model, lr=0.02, weight_decay=0.0, adamw_lr=0.01, adamw_weight_decay=0.0)
    model(torch.randn(4, 2, 2)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- every optimizer trains


def _batch(task: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
    t = get_task(task)
    if task == "cifar10":
        return t, torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    data = t.load()
    x, y = data.train.get_batch(torch.arange(16) * 7)
    return t, x, y


@pytest.mark.parametrize("task", task_names())
@pytest.mark.parametrize("name", NEW)
def test_every_baseline_builds_on_each_task_family_and_lowers_the_loss(
    name: str, task: str
) -> None:
    _needs_package(name)
    t, x, y = _batch(task)
    torch.manual_seed(0)
    model = t.build_model()
    defaults = t.defaults
    opt = build_optimizer(
        name,
        model,
        lr=defaults.base_lr(name),
        weight_decay=defaults.decay(name),
        adamw_lr=defaults.base_lr("adamw"),
        adamw_weight_decay=defaults.decay("adamw"),
        compile_baseline=False,  # the same math; heavyball's compile takes minutes here
    )
    # an arm tuned with a warm-up ramps its lr up, here over the 8 steps (LAMB at
    # text-cnn's lr 0.08 diverges at its full lr from step 0, as kaisa train does not run it)
    warmup = t.arm(False, name)[2] > 0
    initial = [group["lr"] for group in opt.param_groups]
    with torch.no_grad():
        before = float(t.loss(model(x), y))
    for step in range(8):
        for group, base in zip(opt.param_groups, initial):
            group["lr"] = base * (step + 1) / 8 if warmup else base
        opt.zero_grad()
        t.loss(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = float(t.loss(model(x), y))
    assert after < 0.95 * before, (before, after)


@pytest.mark.parametrize(
    ("name", "asked", "mode"),
    [("soap", True, "default"), ("soap", False, None), ("shampoo", True, None)],
)
def test_each_heavyball_optimizer_steps_under_its_own_compile_switch(
    name: str, asked: bool, mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """heavyball reads one global switch at every call: each optimizer sets its own
    before stepping (compiled as heavyball's default, except where compiling fails)."""
    _needs_package(name)
    heavyball = importlib.import_module("heavyball")
    seen: list[Any] = []
    cls = heavyball.SOAP if name == "soap" else heavyball.KLShampoo
    monkeypatch.setattr(
        cls, "step", lambda self, *a, **k: seen.append(heavyball.utils.compile_mode)
    )
    opt = build_optimizer(name, nn.Linear(2, 2), lr=0.1, weight_decay=0.0, compile_baseline=asked)
    default = optim_build._HEAVYBALL_COMPILE["mode"]  # heavyball's own, read before any switch
    assert default is not None  # heavyball compiles by default
    monkeypatch.setattr(heavyball.utils, "compile_mode", "another optimizer's")
    opt.step()
    assert seen == [default if mode == "default" else None]
    assert opt.compiled is (mode == "default")  # type: ignore[attr-defined]


def test_a_missing_package_is_an_error_that_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.import_module

    def without_heavyball(module: str, *args: Any) -> Any:
        if module == "heavyball":
            raise ModuleNotFoundError("No module named 'heavyball'")
        return real(module, *args)

    monkeypatch.setattr(optim_build.importlib, "import_module", without_heavyball)
    with pytest.raises(OptionalDependencyError, match=r"kaisa-lab\[baselines\]"):
        build_optimizer("soap", nn.Linear(2, 2), lr=0.1, weight_decay=0.0)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--task", "digits-mlp", "--optimizers", "sgd,shampoo", "--quiet",
              "--out", str(tmp_path)])  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--optimizers" in err and "'heavyball'" in err and "kaisa-lab[baselines]" in err
    assert not (tmp_path / "results.json").exists()


# ---------------------------------------------------------------- --optimizers


def test_optimizers_give_one_arm_each_plus_kfac_where_it_applies_each_at_its_own_lr() -> None:
    task = get_task("text-lm")
    args = build_parser()[0].parse_args(["compare", "--task", "text-lm",
                                         "--optimizers", "adamw,muon,soap,shampoo,lamb"])  # fmt: skip
    specs = build_specs(args, task, [False, True])
    assert [s.name for s in specs] == [
        "adamw", "adamw+kfac", "muon", "muon+kfac", "soap", "shampoo", "lamb", "lamb+kfac",
    ]  # fmt: skip
    assert {s.optimizer for s in specs if s.kfac} == {"adamw", "muon", "lamb"} & KFAC_BASES
    for spec in specs:
        lr, schedule, warmup = task.arm(spec.kfac, spec.optimizer)
        assert (spec.lr, spec.schedule, spec.warmup_epochs) == (lr, schedule, warmup)
        assert spec.weight_decay == task.defaults.decay(spec.optimizer)
    muon = specs[2]
    assert (muon.adamw_lr, muon.adamw_weight_decay) == (
        task.defaults.lr["adamw"],
        task.defaults.weight_decay["adamw"],
    )
    assert len({s.lr for s in specs if not s.kfac}) > 1  # not one lr for all


def test_an_untuned_baseline_runs_at_its_librarys_lr_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kaisa_lab.tasks import tuned

    selected = {"digits-mlp": {"sgd": tuned.Selection(0.1, 0.0, "constant")}}
    monkeypatch.setattr(tuned, "load", lambda path=None: selected)
    task = get_task("digits-mlp")
    args = build_parser()[0].parse_args(["compare", "--task", "digits-mlp",
                                         "--optimizers", "sgd,muon"])  # fmt: skip
    sgd, _, muon, _ = build_specs(args, task, [False, True])
    assert sgd.lr_tuned and not muon.lr_tuned and muon.lr == BASELINE_LR["muon"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--optimizers", "adamw,muon", "--lr", "0.1"], "argument --lr: one value"),
        (["--optimizers", "adamw,muon", "--kfac-arm-lr", "0.1"], "argument --kfac-arm-lr"),
        (["--optimizers", "adamw,muon", "--weight-decay", "0"], "argument --weight-decay"),
        (["--optimizers", "adamw,lion"], "from sgd, adam, adamw, muon, soap, shampoo, lamb"),
        (["--optimizers", "adamw,adamw"], "named twice"),
        (["--optimizers", "sgd,,adam"], "from sgd, adam, adamw"),  # an empty name
        (["--optimizers", "adamw", "--optimizer", "sgd"], "not allowed with argument"),
    ],
)
def test_optimizers_refuses_what_cannot_fit_several_arms(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "--task", "digits-mlp", *argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_train_refuses_kfac_on_top_of_soap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--task", "digits-mlp", "--optimizer", "soap", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "K-FAC does not run on top of soap" in err and "--no-kfac" in err


@pytest.mark.slow
def test_compare_optimizers_writes_every_arm(tmp_path: Path) -> None:
    pytest.importorskip("heavyball")
    write_fake_cifar(tmp_path / "unused", per_batch=1, n_test=1)  # keeps fakes imported
    out = tmp_path / "out"
    assert main(["compare", "--task", "text-lm", "--optimizers", "adamw,muon,soap",
                 "--epochs", "1", "--max-steps-per-epoch", "3", "--quiet", "--threads", "1",
                 "--no-compile-baselines", "--out", str(out)]) == 0  # fmt: skip
    runs = json.loads((out / "results.json").read_text())
    assert [r["name"] for r in runs] == ["adamw", "adamw+kfac", "muon", "muon+kfac", "soap"]
    assert {r["config"]["compile_baseline"] for r in runs} == {False}
    lrs = {r["name"]: r["config"]["lr"] for r in runs}
    text = get_task("text-lm")
    defaults = text.defaults
    assert lrs == {r["name"]: text.arm(r["kfac"], r["optimizer"])[0] for r in runs}
    assert runs[2]["config"]["adamw_lr"] == defaults.lr["adamw"]
    assert all(r["curve"][-1]["step"] == 3 for r in runs)
    assert all(r["summary"]["baseline"] == "adamw" for r in runs[1:])
    assert (out / "results.png").stat().st_size > 0


def test_the_schedule_scales_muons_adamw_part_by_the_same_factor() -> None:
    from kaisa_lab.cli.distributed import DistContext
    from kaisa_lab.cli.trainer import Trainer

    task = get_task("text-lm")
    args = build_parser()[0].parse_args(["train", "--task", "text-lm", "--optimizer", "muon"])
    (spec,) = build_specs(args, task, [False])
    with Trainer(spec, task, DistContext(device=torch.device("cpu"))) as trainer:
        trainer.set_lr(spec.lr / 4)
        muon_group, adamw_group = trainer.optimizer.param_groups
    assert muon_group["lr"] == spec.lr / 4
    assert adamw_group["lr"] == pytest.approx(task.defaults.lr["adamw"] / 4, rel=1e-12)
