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
from tests.lab.test_bench_costs_steps import COMMITTED, assert_plots, run_quick

from kaisa.planner.costs import CostModel
from kaisa.planner.forecast import forecast, layer_costs
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.costs.scaling import (
    CPU_CLOCK,
    comm_seconds,
    crossover,
    heldout_steps,
    step_clock,
)
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.report import heldout_rows
from kaisa_lab.bench.timing import TIMING_CASES
from kaisa_lab.tasks.registry import get_task

KFAC = {"loss_average": "batch_and_sequence", "grad_worker_fraction": 0.5}


def test_a_forecast_is_the_held_out_steps_times_the_measured_step_and_the_links_collectives(
    tmp_path: Path,
) -> None:
    records = run_quick(
        "large-batch-forecast", tmp_path, f"records={COMMITTED}", 'arms=["adamw","muon+kfac"]'
    )
    want = {
        row.arm.name: row.steps[0]
        for row in heldout_rows(Campaign(get_case("text-lm"), RecordStore(COMMITTED)))
        if row.steps is not None and row.reached == row.seeds
    }
    assert {r["config"]["arm"] for r in records} == {"adamw", "muon+kfac"}
    for r in records:
        res, config = r["result"], r["config"]
        assert config["world"] == 32 // config["per_rank_batch"] == 16  # quick: b = 2
        assert res["measured"] and res["steps"] == want[config["arm"]]
        step_s = (res["step_ms"] + sum(res["comm_ms"].values())) / 1e3
        assert res["forecast_s"] == pytest.approx(res["steps"] * step_s, rel=1e-12)
        assert ("factor_comm" in res["comm_ms"]) == ("+kfac" in config["arm"])
        assert config["clock"] == step_clock("cpu")
    table = TIMING_CASES["large-batch-forecast"].tables["forecast"](records)
    assert "| 2 | 32 | 16 | adamw |" in table and "torch thread(s)" in table
    assert "Per-rank batch 2: " in table
    assert_plots("large-batch-forecast", tmp_path)


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
        run_quick("large-batch-forecast", tmp_path, f"records={COMMITTED}", "per_rank_batch=[2,3]")


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
    records = run_quick("large-batch-forecast", tmp_path, f"records={COMMITTED}", 'arms=["adamw"]')
    measured = [r for r in records if r["result"]["measured"]]
    assert measured and all(r["config"]["clock"] == CPU_CLOCK for r in measured)
    assert [r["result"]["step_ms"] for r in measured] == pytest.approx([250.0] * len(measured))
