"""The node-aware (two-level) link model of the planner.

A collective is charged by where its ranks sit: inside one node at the
intra-node figures, across nodes with an inter-node stage.  KAISA's grid puts
each receiver row on consecutive ranks and each worker column across nodes,
so the forecast must hand each collective its own group; these tests would
catch it handing the wrong one (or a count of ranks).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.config import KFACConfig
from kaisa.planner.costs import CostModel, placement
from kaisa.planner.forecast import auto_fraction, choose_fraction, forecast, layer_costs
from kaisa_lab.cli.main import main

INTER, INTRA = 1e9, 1e11  # bytes/s per rank


def mlp(width: int = 32, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def two_level(latency: float = 0.0, **fields: float) -> CostModel:
    return CostModel(
        bandwidth=INTER,
        latency=latency,
        ranks_per_node=4,
        intra_bandwidth=INTRA,
        intra_latency=latency / 10,
        **fields,
    )


def test_placement_of_rows_columns_and_uneven_groups() -> None:
    assert placement(range(4, 8), 4) == placement((4, 5, 6, 7), 4)
    row = placement(range(4, 8), 4)
    assert (row.ranks, row.nodes, row.most_per_node, row.least_per_node) == (4, 1, 4, 4)
    column = placement(range(1, 16, 4), 4)  # {1, 5, 9, 13}: one per node
    assert (column.nodes, column.most_per_node, column.least_per_node) == (4, 1, 1)
    uneven = placement([3, 4, 5], 4)  # node 0 holds 3, node 1 holds 4 and 5
    assert (uneven.nodes, uneven.most_per_node, uneven.least_per_node) == (2, 2, 1)
    assert placement(16, None) == placement(range(0, 64, 4), None)  # one level: a count
    assert placement([], 4).ranks == 0 and two_level().collective(10, [], 1) == 0.0


def test_a_row_inside_a_node_is_charged_the_intra_node_rate() -> None:
    cost, nbytes = two_level(latency=1e-5), 10**8
    inside = cost.collective(nbytes, range(4, 8), 3)
    assert inside == pytest.approx(3 * 1e-6 * 2 + nbytes / INTRA)
    # a column with one rank per node pays the inter-node rate and depth only
    across = cost.collective(nbytes, range(1, 16, 4), 3)
    assert across == pytest.approx(3 * 1e-5 * 2 + nbytes / INTER)
    # a group of two whole nodes: both stages; the bytes cross each node's
    # link once, over the 4 ranks' shares of it
    both = cost.collective(nbytes, range(8), 1, allreduce=True)
    expected = 1e-6 * 2 + 2 * nbytes / INTRA + 1e-5 * 1 + 2 * nbytes / (4 * INTER)
    assert both == pytest.approx(expected)
    # the bottleneck node of an uneven group holds one rank's share
    uneven = cost.collective(nbytes, [3, 4, 5], 1)
    assert uneven == pytest.approx(1e-6 + nbytes / INTRA + 1e-5 + nbytes / INTER)
    assert cost.collective(nbytes, [6], 1) == 0.0 and cost.collective(0, range(8), 1) == 0.0


def test_one_level_is_unchanged_without_ranks_per_node() -> None:
    """ranks_per_node=None charges every group ``calls·latency·⌈log2 p⌉ +
    bytes/bandwidth`` whatever its ranks; ranks_per_node=1 is the same model."""
    one = CostModel(bandwidth=INTER, latency=1e-5)
    flat = CostModel(bandwidth=INTER, latency=1e-5, ranks_per_node=1)
    for group in (8, range(8), range(1, 32, 4), (0, 1, 2), [5, 9]):
        p = group if isinstance(group, int) else len(group)
        expected = 2 * 1e-5 * math.ceil(math.log2(p)) + 10**6 / INTER
        assert one.collective(10**6, group, 2) == pytest.approx(expected)
        assert flat.collective(10**6, group, 2) == pytest.approx(expected)
    layers = layer_costs(mlp())
    for f in (1 / 16, 1 / 4, 1.0):
        a = forecast(layers, 16, one, grad_worker_fraction=f, inv_update_steps=10)
        b = forecast(layers, 16, flat, grad_worker_fraction=f, inv_update_steps=10)
        for stage, seconds in a.seconds.items():
            assert b.seconds[stage] == pytest.approx(seconds), stage
    # the one-level gradient broadcast: every layer's bytes over the row's count
    mem_opt = forecast(layers, 16, one, grad_worker_fraction=1 / 16)
    grad = sum((la.grad_shape[0] * la.grad_shape[1] + 1) * 4 for la in layers)
    expected = len(layers) * 1e-5 * 4 + grad / INTER
    assert mem_opt.seconds["grad_comm"] == pytest.approx(expected)


def test_forecast_charges_rows_inside_nodes_and_columns_across() -> None:
    """W = 16, 4 ranks per node, f = 1/4: the receiver rows (n = 4
    consecutive ranks) are the nodes, the worker columns {g, g+4, …} have one
    rank per node.  MEM-OPT's rows span all four nodes."""
    layers = layer_costs(mlp())
    grad = sum((la.grad_shape[0] * la.grad_shape[1] + 1) * 4 for la in layers)
    cost = two_level()
    quarter = forecast(layers, 16, cost, grad_worker_fraction=0.25, inv_update_steps=10)
    assert quarter.seconds["grad_comm"] == pytest.approx(grad / INTRA)
    sent = quarter.bytes_inverse_step["second_order_broadcast"]
    assert sent.max() > 0
    assert quarter.seconds["inverse_comm"] == pytest.approx(sent / INTER / 10)
    mem_opt = forecast(layers, 16, cost, grad_worker_fraction=1 / 16, factor_update_steps=1)
    assert mem_opt.seconds["grad_comm"] == pytest.approx(grad / INTRA + grad / (4 * INTER))
    # the factors are reduced over all 16 ranks: both stages
    reduced = mem_opt.bytes_factor_step["factor_reduce"][0]
    counts = 2 * mem_opt.bytes_factor_step["factor_counts"][0]
    expected = (reduced + counts) * (1 / INTRA + 1 / (4 * INTER))
    assert mem_opt.seconds["factor_comm"] == pytest.approx(expected)


def test_node_aware_costs_can_change_the_choice(tmp_path: Path) -> None:
    """With a slow link between nodes and slow products, the one-level model
    avoids every per-step broadcast (COMM-OPT); knowing that the rows of
    f = 1/2 (pairs of ranks) stay inside a node, the two-level one takes it:
    half the preconditioning, and the same inverse traffic per rank.
    ``grad_worker_fraction='auto'`` reads the node fields from plan_costs."""
    layers = layer_costs(mlp(64, 6))
    slow = dict(bandwidth=1e6, latency=0.0, flops=3e8)
    one_level, _ = choose_fraction(layers, 8, CostModel(**slow), inv_update_steps=100)
    nodes = CostModel(**slow, ranks_per_node=2, intra_bandwidth=1e15, intra_latency=0.0)
    two_levels, _ = choose_fraction(layers, 8, nodes, inv_update_steps=100)
    assert one_level == 1.0 and two_levels == 0.5
    nodes.save(tmp_path / "nodes.json")
    config = KFACConfig.from_options(
        grad_worker_fraction="auto", inv_update_steps=100, plan_costs=str(tmp_path / "nodes.json")
    )
    registered = list(KFACPreconditioner(mlp(64, 6)).layers.values())
    assert auto_fraction(registered, 8, config) == 0.5


def test_node_fields_are_checked_and_saved(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="intra_bandwidth"):
        CostModel(ranks_per_node=4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        CostModel(ranks_per_node=0, intra_bandwidth=1.0)
    with pytest.raises(ValueError, match="intra_bandwidth"):
        CostModel(ranks_per_node=4, intra_bandwidth=0.0)
    cost = two_level(latency=1e-5)
    cost.save(tmp_path / "nodes.json")
    assert CostModel.load(tmp_path / "nodes.json") == cost
    # a file written before the node fields existed is one level
    old = {k: v for k, v in json.loads((tmp_path / "nodes.json").read_text()).items()}
    for key in ("ranks_per_node", "intra_bandwidth", "intra_latency"):
        old.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert CostModel.load(tmp_path / "old.json").ranks_per_node is None
    assert "4 ranks per node" in cost.describe_links()


MODEL = (
    "import torch\nfrom torch import nn\n"
    "def small():\n"
    "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), (torch.randn(1, 8),)\n"
)


def test_plan_cli_node_options_reach_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plan_models_nodes.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    args = ["plan", "--model", "plan_models_nodes:small", "--world-size", "8", "--out", str(out)]
    args += ["--bandwidth-gbps", "25", "--ranks-per-node", "4"]
    args += ["--intra-node-bandwidth-gbps", "1200", "--intra-node-latency-us", "2"]
    assert main([*args, "--save-costs", str(tmp_path / "used.json")]) == 0
    assert "4 ranks per node" in capsys.readouterr().out
    used = CostModel.load(tmp_path / "used.json")
    assert used.ranks_per_node == 4 and used.intra_bandwidth == 150e9  # bits, not bytes
    assert used.intra_latency == pytest.approx(2e-6) and used.bandwidth == 25e9 / 8
    report = json.loads((out / "plan.json").read_text())
    assert report["cost_model"]["ranks_per_node"] == 4
    layers = layer_costs(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    for p in report["plans"]:
        fc = forecast(layers, 8, used, grad_worker_fraction=p["grad_worker_fraction"])
        assert p["seconds"]["grad_comm"] == pytest.approx(fc.seconds["grad_comm"].max())
    # the same figures from a --costs file, without the options
    out2 = tmp_path / "out2"
    again = ["plan", "--model", "plan_models_nodes:small", "--world-size", "8"]
    assert main([*again, "--out", str(out2), "--costs", str(tmp_path / "used.json")]) == 0
    assert json.loads((out2 / "plan.json").read_text())["plans"] == report["plans"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*again, "--out", str(out2), "--ranks-per-node", "4"])
    assert "intra-node-bandwidth-gbps" in capsys.readouterr().err
    sys.modules.pop("plan_models_nodes", None)
