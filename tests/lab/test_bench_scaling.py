"""The large-batch forecast (kaisa_lab.bench.costs.scaling): held-out steps
from the campaign's records, the step on one rank measured, the collectives
of W ranks from the planner's cost model. No assertion on speed."""

from __future__ import annotations

import math
import time
import types
from pathlib import Path

import pytest
import torch
from tests.lab.fake_campaign import fill
from tests.lab.test_bench_costs_steps import assert_plots, run_quick

from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import forecast, fractions_for, layer_costs
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.costs.scaling import (
    CPU_CLOCK,
    LAYOUTS,
    busiest_share,
    comm_seconds,
    crossover,
    heldout_steps,
    kfac_shares,
    muon_gather_seconds,
    ns_flops,
    rank_step_ms,
    step_clock,
    timing_passes,
)
from kaisa_lab.bench.costs.task_steps import TaskArm, task_batches
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.rows import heldout_rows
from kaisa_lab.bench.timing import TIMING_CASES
from kaisa_lab.tasks.registry import get_task

KFAC = {"loss_average": "batch_and_sequence", "grad_worker_fraction": 0.5}


def test_a_forecast_is_the_held_out_steps_times_a_ranks_step_in_each_layout(
    tmp_path: Path,
) -> None:
    """Per layout: steps × (the step on one rank with each timed part cut to the
    busiest rank's share of it + the links' collectives). Replicated, every
    rank runs Muon whole and kaisa at COMM-OPT preconditions every layer;
    sharded, Muon's matrices and K-FAC's products are split over the ranks."""
    campaign = fill(tmp_path / "campaign", "text-lm")
    records = run_quick(
        "large-batch-forecast",
        tmp_path,
        f"records={tmp_path / 'campaign'}",
        'arms=["adamw","muon+kfac"]',
    )
    want = {
        row.arm.name: row.steps[0]
        for row in heldout_rows(campaign)
        if row.steps is not None and row.reached == row.seeds
    }
    assert {r["config"]["arm"] for r in records} == {"adamw", "muon+kfac"}
    for r in records:
        res, config = r["result"], r["config"]
        assert config["world"] == 32 // config["per_rank_batch"] == 16  # quick: b = 2
        assert res["measured"] and res["steps"] == want[config["arm"]]
        assert config["clock"] == step_clock("cpu")
        kfac = "+kfac" in config["arm"]
        assert set(res["parts_ms"]) == ({"muon", "decompose", "products"} if kfac else set())
        assert set(res["layouts"]) == set(LAYOUTS)
        for name, plan in res["layouts"].items():
            step = rank_step_ms(res["step_ms"], res["parts_ms"], plan["shares"])
            assert plan["step_ms"] == pytest.approx(step, rel=1e-12)
            total_s = (plan["step_ms"] + sum(plan["comm_ms"].values())) / 1e3
            assert plan["forecast_s"] == pytest.approx(res["steps"] * total_s, rel=1e-12)
            assert ("factor_comm" in plan["comm_ms"]) == kfac
            assert ("muon_allgather" in plan["comm_ms"]) == (kfac and name == "sharded")
        replicated, sharded = res["layouts"]["replicated"], res["layouts"]["sharded"]
        if not kfac:
            assert replicated == {**sharded, "grad_worker_fraction": None}
            assert replicated["step_ms"] == res["step_ms"]  # nothing to split
            continue
        assert replicated["grad_worker_fraction"] == "COMM_OPT"
        assert replicated["shares"]["products"] == 1.0 and "muon" not in replicated["shares"]
        assert sharded["grad_worker_fraction"] in {f"{f:g}" for f in fractions_for(16)} | {
            "COMM_OPT"
        }
        assert 1 / 16 <= sharded["shares"]["muon"] < 1.0  # no split beats an even one
        assert sharded["step_ms"] < replicated["step_ms"]
    table = TIMING_CASES["large-batch-forecast"].tables["forecast"](records)
    assert "| 2 | 32 | 16 | adamw |" in table and "torch thread(s)" in table
    assert "Replicated, per-rank batch 2: " in table and "Sharded, per-rank batch 2: " in table
    # where each step goes: its timed parts and the rest, which add up to the step
    parts = TIMING_CASES["large-batch-forecast"].tables["parts"](records)
    for r in records:
        res = r["result"]
        cells = [
            c.strip()
            for c in next(
                line
                for line in parts.splitlines()
                if line.startswith(f"| 2 | {r['config']['arm']} |")
            )
            .strip("|")
            .split("|")
        ]
        numbers = [0.0 if c == "-" else float(c) for c in cells[2:7]]
        assert numbers[0] == pytest.approx(res["step_ms"], abs=0.05)
        assert sum(numbers[1:]) == pytest.approx(numbers[0], abs=0.2)
        decompose = res["parts_ms"].get("decompose")
        assert cells[7] == ("-" if decompose is None else f"{decompose / res['step_ms']:.1%}")
    assert_plots("large-batch-forecast", tmp_path)


def test_muon_newton_schulz_flops_are_the_ones_torch_runs() -> None:
    """:func:`ns_flops` against torch's own flop counter on Muon's iteration,
    a tall, a wide and a square matrix."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    from torch.utils.flop_counter import FlopCounterMode

    for shape in ((384, 128), (128, 512), (96, 96)):
        for steps in (1, 5):
            with FlopCounterMode(display=False) as counter:
                _zeropower_via_newtonschulz(
                    torch.randn(*shape), (3.4445, -4.7750, 2.0315), steps, 1e-7
                )
            assert ns_flops(shape, steps) == counter.get_total_flops()


def test_the_busiest_share_is_the_greedy_split_largest_first() -> None:
    assert busiest_share([5.0, 1.0], 1) == 1.0
    assert busiest_share([4, 3, 3, 2, 2], 2) == pytest.approx(8 / 14)  # greedy, not 7/14
    assert busiest_share([6, 2, 2], 8) == pytest.approx(0.6)  # more ranks than items
    assert busiest_share([1.0] * 8, 4) == pytest.approx(0.25)
    assert busiest_share([], 4) == 1.0
    with pytest.raises(ValueError, match="world must be >= 1"):
        busiest_share([1.0], 0)


def test_kfacs_shares_are_the_planners_busiest_rank_over_one_rank() -> None:
    torch.manual_seed(0)
    model = get_task("text-lm").build_model()
    cost = CostModel(bandwidth=1e9, latency=1e-5)
    base = {"loss_average": "batch_and_sequence"}
    assert kfac_shares(model, 1, cost, base) == {"decompose": 1.0, "products": 1.0}
    comm_opt = kfac_shares(model, 8, cost, base)
    assert comm_opt["products"] == 1.0  # every rank preconditions every layer
    assert 0.0 < comm_opt["decompose"] < 1.0  # each factor decomposed by its owner
    mem_opt = kfac_shares(model, 8, cost, {**base, "grad_worker_fraction": 0.125})
    layers = layer_costs(model, device="cuda", **base)
    one = forecast(layers, 1, cost, **base).seconds["precondition"].max()
    plan = forecast(layers, 8, cost, **base, grad_worker_fraction=0.125)
    assert mem_opt["products"] == pytest.approx(plan.seconds["precondition"].max() / one)
    assert 0.0 < mem_opt["products"] < 1.0


def test_a_ranks_step_cuts_each_part_to_its_share_and_sharded_muon_gathers() -> None:
    parts = {"muon": 10.0, "products": 6.0, "decompose": 1.0}
    assert rank_step_ms(30.0, parts, {}) == 30.0
    assert rank_step_ms(30.0, parts, {"muon": 0.25, "products": 0.5}) == 30.0 - 7.5 - 3.0
    cost = CostModel(bandwidth=1e9, latency=1e-5)
    shapes = [(128, 512), (512, 128), (384, 128)]
    assert muon_gather_seconds(shapes, 1, cost) == 0.0
    nbytes = 4 * (2 * 128 * 512 + 384 * 128)
    assert muon_gather_seconds(shapes, 2, cost) == cost.collective(nbytes, 2, 2)
    assert muon_gather_seconds(shapes, 8, cost) == cost.collective(nbytes, 8, 1)


def test_a_task_arm_times_its_splittable_parts_inside_its_step() -> None:
    """Muon's step and K-FAC's decompositions and products are read on the
    arm's clock inside the step the arm times, so they add up to less."""
    task = get_task("text-lm")
    data = task.load()
    order = torch.arange(len(data.train))
    batches = task_batches(data, order, 2, 12)
    keywords = {"loss_average": task.loss_average, "inv_update_steps": 10}
    arm = TaskArm(task, "muon+kfac", keywords, batches)
    arm.time_parts(time.process_time)
    for _ in range(12):
        arm()
    parts = arm.parts_ms()
    assert set(parts) == {"muon", "decompose", "products"}
    assert all(v > 0 for v in parts.values())
    assert sum(parts.values()) * arm.calls < 1e3 * arm.cpu_s
    arm.reset()
    assert arm.parts_ms() == {"muon": 0.0, "decompose": 0.0, "products": 0.0}
    assert arm.ns_steps() == 5 and (128, 512) in arm.muon_shapes()
    plain = TaskArm(task, "adamw", None, batches)
    plain()
    assert plain.ns_steps() == 0 and plain.muon_shapes() == []
    with pytest.raises(ValueError, match="time_parts"):
        plain.parts_ms()


def test_a_batch_not_held_out_yet_is_not_forecast(tmp_path: Path) -> None:
    campaign = Campaign(get_case("text-lm-b512"), RecordStore(tmp_path / "empty"))
    assert set(heldout_steps(campaign).values()) == {None}
    records = run_quick(
        "large-batch-forecast", tmp_path, f"records={tmp_path / 'empty'}", 'cases=["text-lm-b512"]'
    )
    assert {r["result"]["measured"] for r in records} == {False}
    assert {r["config"]["world"] for r in records} == {256}
    assert "not held out yet" in TIMING_CASES["large-batch-forecast"].tables["forecast"](records)


def test_a_per_rank_batch_that_does_not_divide_the_global_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="per_rank_batch 3 does not divide text-lm's batch 32"):
        run_quick("large-batch-forecast", tmp_path, f"records={tmp_path}", "per_rank_batch=[2,3]")


def test_what_w_ranks_add_is_the_gradient_allreduce_and_kfacs_collectives() -> None:
    torch.manual_seed(0)
    model = get_task("text-lm").build_model()
    cost = CostModel(bandwidth=1e9, latency=1e-5)
    assert set(comm_seconds(model, 1, cost, KFAC).values()) == {0.0}
    first = comm_seconds(model, 8, cost, None)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert first == {"allreduce": cost.collective(grad_bytes, 8, 1, allreduce=True)}
    ours = comm_seconds(model, 8, cost, KFAC)
    plan = forecast(layer_costs(model, device="cuda", **KFAC), 8, cost, **KFAC)
    for stage in ("factor_comm", "inverse_comm", "grad_comm"):
        assert ours[stage] == float(plan.seconds[stage].max())
    assert ours["factor_comm"] > 0 and ours["grad_comm"] > 0  # f = 1/2: gradients broadcast
    assert ours["allreduce"] == first["allreduce"]


def test_the_crossover_is_the_least_w_where_kfac_beats_every_peer_by_more_than_a_tie() -> None:
    times = {
        16: {"muon": 10.0, "adamw": 12.0, "muon+kfac": 9.8},  # a tie with muon
        64: {"muon": 10.0, "adamw": 9.0, "muon+kfac": 8.0},
        256: {"muon": 10.0, "adamw": 9.0, "muon+kfac": 5.0},
    }
    assert crossover(times, ["muon+kfac"], ["muon", "adamw"]) == (64, "muon+kfac")
    times[64]["adamw"] = 8.2
    assert crossover(times, ["muon+kfac"], ["muon", "adamw"]) == (256, "muon+kfac")
    assert crossover({16: {"muon": 1.0, "muon+kfac": math.inf}}, ["muon+kfac"], ["muon"]) is None


def test_held_out_steps_count_a_miss_as_never_and_carry_the_selected_knobs(
    tmp_path: Path,
) -> None:
    """Synthetic records of the quick case: every grid setting on the selection
    seeds (the first lr fastest), then the held-out seeds of the selection."""
    case = get_case("quick")
    store = RecordStore(tmp_path)
    arm = case.arm("sgd+kfac tuned")

    def write(setting: object, seed: int, steps: int | None) -> None:
        run = Campaign(case, store).run(arm, setting, seed, "grid")  # type: ignore[arg-type]
        reached = steps is not None
        result = {
            "time_to_target_s": float(steps) if reached else None,
            "steps_to_target": steps,
            "final_metric": 0.9 if reached else 0.5,
            "reached": reached,
        }
        store.write(
            {"kind": "train", "case": case.name, "arm": arm.kind, "key": run.key, "seed": seed,
             "role": "grid", "result": result}
        )  # fmt: skip

    campaign = Campaign(case, store)
    for i, setting in enumerate(case.grid(arm)):
        for seed in campaign.protocol.selection_seeds:
            write(setting, seed, 10 + i)
    while (state := Campaign(case, store).state(arm)).stage == "followup":
        for seed in campaign.protocol.selection_seeds:
            write(state.pending, seed, 99)
    assert heldout_steps(Campaign(case, store))[arm.name] is None  # not held out yet
    selected = Campaign(case, store).state(arm).selected
    seeds = campaign.protocol.heldout_seeds
    assert selected is not None and len(seeds) == 2
    write(selected, seeds[0], 30)
    assert heldout_steps(Campaign(case, store))[arm.name] is None  # one held-out seed to go
    write(selected, seeds[1], None)  # a miss
    steps, knobs = heldout_steps(Campaign(case, store))[arm.name]  # type: ignore[misc]
    assert steps == math.inf and knobs == dict(selected.kfac)  # median of 30 and never
    write(selected, seeds[1], 20)
    steps, _ = heldout_steps(Campaign(case, store))[arm.name]  # type: ignore[misc]
    assert steps == 25.0


def test_a_step_on_one_cpu_thread_is_timed_by_cpu_time_and_elsewhere_by_the_wall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank of the forecast runs alone: on a CPU at one thread its step is the
    process's CPU time, which the machine's other work does not lengthen."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert step_clock("cpu") == CPU_CLOCK
    assert step_clock("cuda") == step_clock("cuda:0") == "wall clock"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert step_clock("cpu") == "wall clock"  # CPU time would sum the threads


def test_the_forecast_times_a_cpu_step_by_the_process_cpu_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one CPU thread the step is read from ``time.process_time`` (a clock that
    here advances 0.25 s a reading), not from the wall clock."""
    from kaisa_lab.bench.costs import scaling

    ticks = iter(range(10**6))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    clocks = types.SimpleNamespace(
        process_time=lambda: 0.25 * next(ticks), perf_counter=time.perf_counter
    )
    monkeypatch.setattr(scaling, "time", clocks)  # scaling's readings only
    fill(tmp_path / "campaign", "text-lm")
    records = run_quick(
        "large-batch-forecast", tmp_path, f"records={tmp_path / 'campaign'}", 'arms=["adamw"]'
    )
    measured = [r for r in records if r["result"]["measured"]]
    assert measured and all(r["config"]["clock"] == CPU_CLOCK for r in measured)
    assert [r["result"]["step_ms"] for r in measured] == pytest.approx([250.0] * len(measured))


def test_a_task_arm_carries_the_levers_that_change_a_steps_cost() -> None:
    """An eighth of the positions (the capture cut, as a training run's) and
    Muon's Newton–Schulz iterations; a lever with a pass of its own is refused."""
    task = get_task("text-lm")
    data = task.load()
    batches = task_batches(data, torch.arange(len(data.train)), 2, 2)
    keywords = {"loss_average": task.loss_average}
    lever = {"position_fraction": 0.125, "muon_ns_steps": 3}
    arm = TaskArm(task, "muon+kfac", keywords, batches, lever=lever)
    assert arm.ns_steps() == 3
    assert arm.precond is not None
    assert arm.precond.config.factor_position_fraction == 0.125
    assert all(layer.adapter.positions is not None for layer in arm.precond.layers.values())
    plain = TaskArm(task, "muon+kfac", keywords, batches)
    assert plain.precond is not None
    assert not any(layer.adapter.positions for layer in plain.precond.layers.values())
    with pytest.raises(ValueError, match=r"\['fisher'\] are not timed here"):
        TaskArm(task, "muon+kfac", keywords, batches, lever={"fisher": "mc"})
    with pytest.raises(ValueError, match="position_fraction: a K-FAC arm's lever"):
        TaskArm(task, "muon", None, batches, lever={"position_fraction": 0.5})
    # K-FAC on Muon's AdamW part only: every layer but those owning a Muon matrix
    part = TaskArm(task, "muon+kfac", keywords, batches, lever={"kfac_layers": "adamw-part"})
    assert part.precond is not None
    muon = {n for n, p in part.model.named_parameters() if p.dim() >= 2} & set(
        part.opt.split.muon  # type: ignore[attr-defined]
    )
    owners = {n.rpartition(".")[0] for n in muon}
    kept = set(part.precond.layers)
    assert kept and kept < set(plain.precond.layers)
    assert kept == {
        n
        for n in plain.precond.layers
        if n.removesuffix(".q").removesuffix(".k").removesuffix(".v") not in owners
    }
    with pytest.raises(ValueError, match="kfac_layers='adamw-part'"):
        TaskArm(task, "adamw+kfac", keywords, batches, lever={"kfac_layers": "adamw-part"})


def test_the_forecast_finds_each_arm_with_its_lever(tmp_path: Path) -> None:
    """The large-batch arm with the Gram levers is forecast with them: its
    K-FAC keyword in its knobs once held out, its run field beside them."""
    from kaisa_lab.bench.costs.scaling import _found

    options = {
        "cases": ["text-lm-b512"],
        "arms": ["muon+kfac", "muon+kfac-pos0.125-bf16"],
        "per_rank_batch": [8],
    }
    _, found = _found(options, RecordStore(tmp_path))
    by_name = {name: (steps, knobs, lever) for _, _, name, steps, knobs, lever in found}
    assert by_name["muon+kfac"] == (None, None, {})
    assert by_name["muon+kfac-pos0.125-bf16"] == (None, None, {"position_fraction": 0.125})


def test_a_gpus_parts_are_timed_in_turns_of_their_own() -> None:
    """A part's reading syncs the device, so on a GPU the kept step times come
    from turns without them; on a CPU one turn serves both."""
    assert timing_passes(None) == [(True, True)]
    assert timing_passes(lambda: None) == [(True, False), (False, True)]
