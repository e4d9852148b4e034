"""The planner in one process: cost model, fractions, choice, rows, CLI.

Its bytes and memory are checked against real runs at W=1, 2, 4 in
tests/distributed/test_forecast_matches_runs.py; here the parts that need no ranks.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.config import AssignmentStrategy, ComputeMethod
from kaisa.core.specs import FactorKind
from kaisa.methods import method_for
from kaisa.planner.costs import CostModel, measure_costs
from kaisa.planner.forecast import choose_fraction, forecast, fractions_for, layer_costs
from kaisa.planner.probe import probe_rows
from kaisa_lab.cli.main import main


def mlp(width: int = 16, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def test_cost_model_rejects_bad_fields_and_round_trips(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        CostModel(bandwidth=0)
    with pytest.raises(ValueError, match="eigh_n3"):
        CostModel(eigh_n3=-1.0)
    cost = CostModel(flops=3e12, device="x")
    cost.save(tmp_path / "c.json")
    assert CostModel.load(tmp_path / "c.json") == cost
    (tmp_path / "bad.json").write_text(json.dumps({"flops": 1.0, "speed": 2}))
    with pytest.raises(ValueError, match="speed"):
        CostModel.load(tmp_path / "bad.json")
    assert cost.collective(10**6, 1, 1) == 0.0  # nothing to send to oneself
    assert cost.collective(10**6, 8, 1, True) > cost.collective(10**6, 8, 1)


def test_measured_costs_grow_with_n_cubed() -> None:
    cost = measure_costs("cpu", sizes=(64, 128, 256), repeats=2)
    assert cost.flops > 1e8 and cost.eigh_n3 > 0 and cost.inverse_n3 > 0
    assert cost.bf16_flops is not None and cost.bf16_flops > 1e7  # measured, not assumed
    assert cost.decompose(512, "eigh") > cost.decompose(128, "eigh")
    assert cost.decompose(512, "eigh", dense=False) < cost.decompose(512, "eigh")


def test_fractions_for_small_and_huge_worlds() -> None:
    assert fractions_for(12) == [m / 12 for m in (1, 2, 3, 4, 6, 12)]
    big = fractions_for(4096)
    assert big[0] == 1 / 4096 and big[-1] == 1.0 and len(big) == 13  # 2^0 .. 2^12 workers


def test_choice_fits_the_budget_and_falls_back_to_mem_opt() -> None:
    layers = layer_costs(mlp())
    free, options = choose_fraction(layers, 8, factor_update_steps=1, inv_update_steps=10)
    fastest = min(options, key=lambda fc: fc.overhead().max())
    assert free == fastest.fraction
    memories = sorted({int(fc.memory["total"].max()) for fc in options})
    tight = memories[0] + 1
    chosen, _ = choose_fraction(layers, 8, None, tight, factor_update_steps=1)
    assert next(fc for fc in options if fc.fraction == chosen).memory["total"].max() <= tight
    impossible, _ = choose_fraction(layers, 8, None, 1.0)
    assert impossible == 1 / 8


def test_forecast_at_4096_ranks_is_quick_and_consistent() -> None:
    layers = layer_costs(mlp(32, 20))
    fc = forecast(layers, 4096, grad_worker_fraction=1 / 64)
    assert fc.grad_workers == 64
    # every factor is owned once: the ranks' factor memory adds up to the model's
    per_layer = (33 * 33 + 32 * 32) * 4
    assert fc.memory["factors"].sum() == 20 * per_layer
    # MEM-OPT sends each preconditioned gradient every step; COMM-OPT never
    assert fc.bytes_every_step["grad_broadcast"].min() > 0
    comm_opt = forecast(layers, 4096, grad_worker_fraction=1.0)
    assert comm_opt.bytes_every_step["grad_broadcast"].max() == 0


def test_probe_counts_the_rows_of_a_conv_and_a_sequence() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Flatten(), nn.Linear(4 * 3 * 3, 2))
    rows = probe_rows(model, (torch.randn(2, 3, 7, 7),), scale=5)
    assert rows == {"0": 2 * 3 * 3 * 5, "2": 2 * 5}
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no trace


def test_probe_counts_the_rows_a_fraction_of_the_positions_reads() -> None:
    """A call of T positions is read at ⌈f·T⌉ of them; a one-position call
    whole; so the forecast's Gram costs are the cut ones."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.Flatten(), nn.Linear(4 * 3 * 3, 2))
    example = (torch.randn(2, 3, 7, 7),)
    rows = probe_rows(model, example, scale=5, factor_position_fraction=0.25, damping=0.1)
    assert rows == {"0": 2 * 3 * 5, "2": 2 * 5}  # ⌈0.25·9⌉ = 3 of the conv's 9 positions
    every = layer_costs(model, probe_rows(model, example, scale=5))
    cut = layer_costs(model, rows, factor_position_fraction=0.25)
    assert cut[0].rows is not None and every[0].rows is not None
    assert forecast(cut, 4).seconds["capture"].max() < forecast(every, 4).seconds["capture"].max()


def test_auto_fraction_and_budget_option() -> None:
    precond = KFACPreconditioner(mlp(), grad_worker_fraction="auto", memory_budget_mb=64)
    assert precond.plan.grad_worker_fraction == 1.0
    with pytest.raises(ValueError, match="memory_budget_mb"):
        KFACPreconditioner(mlp(), memory_budget_mb=0)
    # read only by 'auto': given with a fixed fraction, they say they are unused
    with pytest.warns(UserWarning, match=r"memory_budget_mb=64 is read only to choose .*'auto'"):
        KFACPreconditioner(mlp(), grad_worker_fraction=1.0, memory_budget_mb=64)
    with pytest.warns(UserWarning, match=r"plan_costs='c.json' and memory_budget_mb=64 are read"):
        KFACPreconditioner(mlp(), plan_costs="c.json", memory_budget_mb=64)


def test_diagonal_inverse_is_not_sent_as_a_triangle() -> None:
    """Regression: symmetry_aware packing of a diagonal factor's inverse
    (an Embedding's A) indexed a vector as a matrix."""
    emb = nn.Embedding(7, 3)
    specs = layer_costs(nn.Sequential(emb))[0].factors
    assert {s.kind for s in specs} == {FactorKind.DIAGONAL, FactorKind.DENSE}
    for method in ComputeMethod:
        for t in method_for(method, True).held(specs, colocated=True):
            assert not t.symmetric or len(t.shape) == 2


def test_plan_cli_prints_every_fraction_and_a_recommendation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "plan_models.py"
    module.write_text(
        "import torch\nfrom torch import nn\n"
        "def small():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(1, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    args = ["plan", "--model", "plan_models:small", "--world-size", "2", "8", "--out", str(out)]
    assert main([*args, "--memory-budget-mib", "1", "--kfac-inv-update-steps", "10"]) == 0
    printed = capsys.readouterr().out
    assert "recommended" in printed and "inv_update_steps': 10" in printed
    report = json.loads((out / "plan.json").read_text())
    assert {p["world_size"] for p in report["plans"]} == {2, 8}
    for world in (2, 8):
        assert sum(p["recommended"] for p in report["plans"] if p["world_size"] == world) == 1
    assert (out / "plan.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["plan", "--model", "no_colon", "--out", str(out)])
    assert "MODULE:CALLABLE" in capsys.readouterr().err
    sys.modules.pop("plan_models", None)


def test_fold_and_conv_capture_are_costed() -> None:
    """The running-average fold (three passes over each factor, on its owner,
    every factor step) and the row copies before a Gram are in the time model:
    benchmarks/plan_accuracy.py measured both missing.  A convolution writes
    its patches once (kaisa.layers.patches), as a Linear writes its rows."""
    cost = CostModel(memory_bandwidth=1e9, flops=1e12)
    conv = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 25, 3))
    rows = probe_rows(conv, (torch.randn(1, 4, 5, 5),), scale=2)
    layers = layer_costs(conv, rows)
    assert [la.input_copies for la in layers] == [1, 1]
    fc = forecast(layers, 1, cost, factor_update_steps=2)
    numel = sum(s.numel for la in layers for s in la.factors)
    assert fc.seconds["factor_fold"][0] == pytest.approx(3 * numel * 4 / 1e9 / 2)
    copied = [dataclasses.replace(layers[0], input_copies=3)]
    extra = forecast(copied, 1, cost, factor_update_steps=1).seconds["capture"][0]
    extra -= forecast(layers[:1], 1, cost, factor_update_steps=1).seconds["capture"][0]
    a_dim = layers[0].factors[0].dim
    assert extra == pytest.approx(2 * 2 * rows["0"] * a_dim * 4 / 1e9)
    # with accumulation every micro-batch of a factor step is captured
    one = forecast(layers, 1, cost).seconds["capture"][0]
    assert forecast(layers, 1, cost, accumulation_steps=4).seconds["capture"][0] == 4 * one


def test_plan_cli_takes_a_given_cost_model_and_a_link_in_gigabits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "plan_models_costs.py"
    module.write_text(
        "import torch\nfrom torch import nn\n"
        "def small():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(1, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    given = CostModel(eigh_n3=7e-12, eigh_fixed=3e-3, flops=2e13, device="given")
    given.save(tmp_path / "gpu.json")
    out = tmp_path / "out"
    args = ["plan", "--model", "plan_models_costs:small", "--world-size", "4", "--out", str(out)]
    args += ["--costs", str(tmp_path / "gpu.json"), "--bandwidth-gbps", "100"]
    args += ["--latency-us", "10", "--save-costs", str(tmp_path / "used.json")]
    assert main(args) == 0
    capsys.readouterr()
    used = CostModel.load(tmp_path / "used.json")
    assert used.bandwidth == 12.5e9 and used.latency == pytest.approx(1e-5)  # bits, not bytes
    assert (used.eigh_n3, used.eigh_fixed, used.flops) == (7e-12, 3e-3, 2e13)
    report = json.loads((out / "plan.json").read_text())
    assert report["cost_model"]["bandwidth"] == 12.5e9
    # the decompositions were timed with the given model: one factor of n=9 on a rank
    layers = layer_costs(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    expected = forecast(layers, 4, used, grad_worker_fraction=1.0).seconds["decompose"].max()
    comm_opt = next(p for p in report["plans"] if p["grad_worker_fraction"] == 1.0)
    assert comm_opt["seconds"]["decompose"] == pytest.approx(expected)
    sys.modules.pop("plan_models_costs", None)


def test_auto_fraction_uses_the_given_cost_model(tmp_path: Path) -> None:
    """'auto' at start-up predicts with config.plan_costs: a slow link makes
    COMM-OPT (no per-step traffic, decompositions sent every 100 steps) win,
    a fast link and slow products a fraction that splits the preconditioning."""
    from kaisa.config import KFACConfig
    from kaisa.planner.forecast import auto_fraction

    layers = list(KFACPreconditioner(mlp(64, 6)).layers.values())
    picks = {}
    for name, cost in {
        "slow link": CostModel(bandwidth=1e3, latency=1e-3),
        "slow products": CostModel(bandwidth=1e15, latency=0.0, flops=1e6),
    }.items():
        cost.save(tmp_path / f"{name}.json")
        path = str(tmp_path / f"{name}.json")
        config = KFACConfig.from_options(
            grad_worker_fraction="auto", inv_update_steps=100, plan_costs=path
        )
        picks[name] = auto_fraction(layers, 8, config)
        expected, _ = choose_fraction(layer_costs(mlp(64, 6)), 8, cost, inv_update_steps=100)
        assert picks[name] == expected
    assert picks["slow link"] == 1.0 and picks["slow products"] < 1.0
    with pytest.raises(TypeError, match="plan_costs"):
        KFACConfig(plan_costs=3)
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    for bad in (tmp_path / "no", garbled, tmp_path):  # missing, not JSON, a folder
        with pytest.raises(ValueError, match=r"plan_costs=.* is not a cost model kaisa can read"):
            KFACPreconditioner(mlp(), grad_worker_fraction="auto", plan_costs=str(bad))


def test_large_factors_are_planned_per_block_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factor above max_factor_dim costs the planner its blocks (Σ b³, Σ b²
    entries), or d if diagonal, and ``kaisa plan`` names it."""
    model = nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 4))
    dense = layer_costs(model, max_factor_dim=None)
    block = layer_costs(model, max_factor_dim=128, large_factor="block")
    diagonal = layer_costs(model, max_factor_dim=128)
    g = block[0].factors[1]
    assert g.kind is FactorKind.BLOCK_DIAGONAL and g.layout.sizes() == [100, 100, 100]
    assert g.cost(AssignmentStrategy.COMPUTE) == 3 * 100**3
    assert g.cost(AssignmentStrategy.MEMORY) == 3 * 100**2
    assert diagonal[0].factors[1].cost(AssignmentStrategy.COMPUTE) == 300
    assert block[0].limited_labels() == ["0.G (300 block-diagonal 3×100)"]
    assert block[1].limited_labels() == ["2.A (301 block-diagonal 1×101+2×100)"]
    assert dense[0].limited_labels() == [] and dense[0].factors[1].kind is FactorKind.DENSE
    memory = {
        name: forecast(layers, 1).memory["factors"][0]
        for name, layers in (("dense", dense), ("block", block), ("diagonal", diagonal))
    }
    a0, a1 = 9 * 9, 4 * 4
    assert memory["dense"] == 4 * (a0 + 300 * 300 + 301 * 301 + a1)
    assert memory["block"] == 4 * (a0 + 3 * 100**2 + (101**2 + 2 * 100**2) + a1)
    assert memory["diagonal"] == 4 * (a0 + 300 + 301 + a1)
    seconds = {
        name: forecast(layers, 1).seconds["decompose"][0]
        for name, layers in (("dense", dense), ("block", block))
    }
    assert seconds["block"] < seconds["dense"] / 4
    module = tmp_path / "wide_models.py"
    module.write_text(
        "import torch\nfrom torch import nn\n"
        "def wide():\n"
        "    return nn.Sequential(nn.Linear(8, 300), nn.ReLU(), nn.Linear(300, 4)), "
        "(torch.randn(1, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    args = ["plan", "--model", "wide_models:wide", "--world-size", "2", "--out", str(out)]
    assert main([*args, "--kfac-max-factor-dim", "128", "--kfac-large-factor", "block"]) == 0
    printed = capsys.readouterr().out
    assert (
        "factors above max_factor_dim=128, not kept dense: 0.G (300 block-diagonal 3×100), "
        "2.A (301 block-diagonal 1×101+2×100)" in printed
    )
    report = json.loads((out / "plan.json").read_text())
    assert report["large_factors"] == [
        "0.G (300 block-diagonal 3×100)",
        "2.A (301 block-diagonal 1×101+2×100)",
    ]
    assert main([*args, "--kfac-max-factor-dim", "none"]) == 0
    assert "not kept dense" not in capsys.readouterr().out
    sys.modules.pop("wide_models", None)


def test_forecast_refuses_an_unknown_option() -> None:
    layers = layer_costs(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['inv_update_step'\]"):
        forecast(layers, 2, inv_update_step=10)


def test_auto_fraction_counts_the_cpu_workspace_against_the_budget(tmp_path: Path) -> None:
    """'auto' on the CPU sees the memory layer_costs (and kaisa plan) count: a
    budget between COMM-OPT's memory without and with the products' workspace
    rules COMM-OPT out."""
    from kaisa.config import KFACConfig
    from kaisa.planner.forecast import auto_fraction

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    layers = list(KFACPreconditioner(model).layers.values())
    kfac = dict(factor_update_steps=10, inv_update_steps=100)
    counted = layer_costs(model, **kfac)
    slow = CostModel(bandwidth=1e6)  # per-step gradient broadcasts dear: COMM-OPT wins
    path = tmp_path / "costs.json"
    slow.save(path)
    free, _ = choose_fraction(counted, 4, slow, None, **kfac)
    assert free == 1.0
    f1 = forecast(counted, 4, slow, grad_worker_fraction=1.0, **kfac).memory
    workspace = int(f1["workspace"].max())
    assert workspace > 0
    budget_mb = (f1["total"].max() - workspace / 2) / 2**20  # fits only without the workspace
    expected, _ = choose_fraction(counted, 4, slow, budget_mb * 2**20, **kfac)
    assert expected < 1.0
    config = KFACConfig(memory_budget_mb=budget_mb, plan_costs=str(path), **kfac)
    assert auto_fraction(layers, 4, config) == expected


def test_auto_fraction_sees_the_method_the_run_resolves(tmp_path: Path) -> None:
    """'auto' forecasts the method the preconditioner runs: with grafting (its
    running moments held, the stacked copies not) COMM-OPT's memory differs,
    and a budget between the two memories gives different fractions; a
    user's ``method=`` replaces ``compute_method``."""
    from kaisa.config import KFACConfig
    from kaisa.methods import InverseMethod
    from kaisa.planner.forecast import auto_fraction

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    layers = list(KFACPreconditioner(model).layers.values())
    kfac = dict(factor_update_steps=10, inv_update_steps=100, compute_method="eigen")
    costs = layer_costs(model, **kfac)
    slow = CostModel(bandwidth=1e6)  # per-step gradient broadcasts dear: COMM-OPT wins
    path = tmp_path / "costs.json"
    slow.save(path)
    plain = forecast(costs, 4, slow, grad_worker_fraction=1.0, **kfac)
    grafted = forecast(costs, 4, slow, grad_worker_fraction=1.0, grafting="adam", **kfac)
    assert grafted.config["compute_method"] == "eigen"
    sizes = sorted([plain.memory["total"].max(), grafted.memory["total"].max()])
    assert sizes[0] < sizes[1]
    budget_mb = sum(sizes) / 2 / 2**20
    picks = {}
    for grafting in (None, "adam"):
        config = KFACConfig.from_options(
            memory_budget_mb=budget_mb, plan_costs=str(path), grafting=grafting, **kfac
        )
        extra = {} if grafting is None else {"grafting": grafting}
        expected, _ = choose_fraction(costs, 4, slow, budget_mb * 2**20, **extra, **kfac)
        picks[grafting] = auto_fraction(layers, 4, config)
        assert picks[grafting] == expected
    assert picks[None] != picks["adam"]  # the budget tells the two methods apart
    # a user's method= is what is forecast, not compute_method's
    inverse = forecast(costs, 4, method=InverseMethod(), grad_worker_fraction=1.0, **kfac)
    assert inverse.config["compute_method"] == "inverse"
    chosen, options = choose_fraction(costs, 4, None, None, InverseMethod(), **kfac)
    assert {fc.config["compute_method"] for fc in options} == {"inverse"}
    assert auto_fraction(layers, 4, KFACConfig.from_options(**kfac), InverseMethod()) == chosen


def test_bfloat16_products_are_costed_at_their_own_rate(tmp_path: Path) -> None:
    """``factor_compute_dtype`` and ``precondition_dtype`` put the Grams and
    the preconditioning products in bfloat16, which runs at the cost model's
    ``bf16_flops``: capture's Gram part and the products scale by
    ``flops / bf16_flops``; without a bfloat16 rate, or in float32, nothing
    changes.  A cost model saved before the field existed still loads."""
    layers = layer_costs(mlp(), {f"{i}": 64 for i in range(0, 8, 2)})
    base = CostModel(flops=1e12, memory_bandwidth=1e30)  # the Grams' row copies cost nothing
    fast = dataclasses.replace(base, bf16_flops=4e12)
    lean = {"factor_compute_dtype": "bfloat16", "precondition_dtype": "bfloat16"}
    f32 = forecast(layers, 1, fast).seconds
    bf16 = forecast(layers, 1, fast, **lean).seconds
    for stage in ("capture", "precondition"):
        assert f32[stage][0] > 0
        assert bf16[stage][0] == pytest.approx(f32[stage][0] / 4)
        assert forecast(layers, 1, base, **lean).seconds[stage][0] == pytest.approx(f32[stage][0])
    only_grams = forecast(layers, 1, fast, factor_compute_dtype="bfloat16").seconds
    assert only_grams["capture"][0] == pytest.approx(f32["capture"][0] / 4)
    assert only_grams["precondition"][0] == pytest.approx(f32["precondition"][0])
    with pytest.raises(ValueError, match="bf16_flops"):
        CostModel(bf16_flops=0.0)
    old = {k: v for k, v in dataclasses.asdict(base).items() if k != "bf16_flops"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert CostModel.load(tmp_path / "old.json") == base
