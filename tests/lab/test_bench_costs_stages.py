"""The cost cases of a step's stages and launches: each runs, and its records hold together.

``stages``, ``step-launches``, ``step-breakdown`` and ``plan-accuracy`` run
with small options through ``kaisa bench run``. No assertion on speed (the
machine is shared): what is checked is that every stage and arm is there,
that every timed stage was timed (a boundary the step stopped reaching
would read 0), that the stages add up to about the K-FAC overhead measured
independently (the K-FAC model's step less its plain twin's), so a stage
dropped from the split shows, and that the tables and plots render from the
records alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kaisa_lab.bench import costs
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.timing import TIMING_CASES, latest
from kaisa_lab.cli.main import main

FIXED = (
    "capture: hooks and sums",
    "reduce",
    "running average",
    "decomposition",
    "preconditioning products",
    "KL clip + write-back",
    "step() bookkeeping",
)
#: no kernel stands for them (one process reduces nothing; bookkeeping is Python)
NO_FLOOR = {"capture: hooks and sums", "reduce", "step() bookkeeping"}
COLD = {"running average", "KL clip + write-back"}


def run(case: str, tmp_path: Path, *options: str, quick: bool = True) -> list[dict[str, Any]]:
    """``kaisa bench run CASE`` into ``tmp_path``; the records it wrote."""
    given = [f"--option={o}" for o in options]
    argv = ["bench", "run", case, "--records", str(tmp_path), *given]
    assert main([*argv, "--quick"] if quick else argv) == 0
    return latest(RecordStore(tmp_path), case)


def render(case: str, records: Sequence[Mapping[str, Any]], tmp_path: Path) -> None:
    """Every table renders a markdown table; the plot writes a PNG."""
    timing = TIMING_CASES[case]
    for table in timing.tables.values():
        assert "|---|" in table(records)
    assert timing.plot is not None
    timing.plot(records, tmp_path / f"{case}.png")
    assert (tmp_path / f"{case}.png").stat().st_size > 0


def test_stages_has_every_stage_with_a_floor_and_adds_up(tmp_path: Path) -> None:
    records = run("stages", tmp_path)
    runs = costs.stages.runs(records)
    settings = {(r["config"]["method"], r["config"]["factor_steps"], r["config"]["inv_steps"])
                for r in runs}  # fmt: skip
    assert settings == {tuple(s) for s in costs.stages.SETTINGS}
    stage_sums, overheads = 0.0, 0.0
    for r in runs:
        stages = {st["stage"]: st for st in r["stages"]}
        for source in ("A", "G"):
            assert f"capture: {source} (Linear)" in stages, sorted(stages)
        assert set(FIXED) <= set(stages), sorted(stages)
        for name, st in stages.items():
            assert st["ms"] > 0, (r["config"]["setting"], name, st)
            assert st["median_ms"] == st["ms"]  # what ab compares
            if name not in NO_FLOOR:
                assert st["floor_ms"] > 0 and st["ratio"] > 0, (name, st)
                assert st["calls"] > 0, (name, st)
            # the cold floor is the floor itself except for the memory-bound stages
            if name in COLD:
                assert st["cold_floor_ms"] > 0, (name, st)
            else:
                assert st["cold_floor_ms"] == st["floor_ms"], (name, st)
        t = r["totals"]
        total = sum(st["ms"] for st in stages.values())
        assert t["stage_sum_ms"] == pytest.approx(total, abs=1e-9)
        cold = sum(st["cold_floor_ms"] for st in stages.values())
        assert t["cold_floor_sum_ms"] == pytest.approx(cold, abs=1e-9)
        assert t["overhead_over_cold_floor"] == pytest.approx(total / cold)
        assert t["unattributed_ms"] == pytest.approx(t["overhead_ms"] - total)
        # every timer sits inside the K-FAC model's step
        assert t["stage_sum_ms"] <= t["kfac_step_ms"]
        assert t["window_steps"] % r["config"]["inv_steps"] == 0
        stage_sums += t["stage_sum_ms"]
        overheads += t["overhead_ms"]
    # summed over the settings, so one noisy window does not decide
    assert 0.4 * overheads <= stage_sums <= 2.5 * overheads, (stage_sums, overheads)
    render("stages", records, tmp_path)


def test_a_convolutions_a_term_has_its_rows_and_gram_in_its_floor(tmp_path: Path) -> None:
    """A convolution builds its patch rows inside the Gram: its A stage's floor
    is a copy of the rows plus their Gram, so it is within a small factor of it
    (charged as an Embedding's count, it read 35×)."""
    records = run(
        "stages", tmp_path, 'models=["digits-cnn"]',
        'settings=[["eigen", 1, 10]]', "steps=2", "batch=128", quick=False,
    )  # fmt: skip
    (r,) = costs.stages.runs(records)
    stages = {st["stage"]: st for st in r["stages"]}
    conv = stages["capture: A (Conv2d)"]
    assert conv["calls"] > 0 and 0.3 < conv["ratio"] < 10, conv


def test_ab_compares_every_stage_before_and_after(tmp_path: Path) -> None:
    """``kaisa bench ab stages`` (what a before/after script did): each stage
    of each setting, before and after, its median over the rounds."""
    from kaisa_lab.bench.ab import _ROOT, ab

    arguments = ["--quick", '--option=settings=[["eigen", 1, 10]]']
    records = ab("stages", str(_ROOT), rounds=1, arguments=arguments)
    arms = {r["arm"] for r in records}
    prefix = "tiny-mlp eigen f=1 inv=10 · "
    assert {prefix + s for s in FIXED} <= arms
    assert prefix + costs.stages.TOTAL in arms
    for r in records:
        res = r["result"]
        assert len(res["before_rounds_ms"]) == len(res["after_rounds_ms"]) == 1


def test_step_launches_counts_fewer_products_when_stacked(tmp_path: Path) -> None:
    records = run(
        "step-launches", tmp_path, 'models=["lm-12x64"]', "rounds=1", "block=1",
        "factor_steps=2", "inv_steps=100",
    )  # fmt: skip
    arms = costs.launches.by_model(records)["lm-12x64"]
    assert set(arms) == {"first-order", "kaisa stacked", "kaisa per layer"}
    stacked = arms["kaisa stacked"]["result"]
    single = arms["kaisa per layer"]["result"]
    layers = arms["kaisa stacked"]["config"]["layers"]
    assert layers == 74
    # 12 identical blocks: the products follow the shapes, not the 74 layers
    assert stacked["products"] < single["products"] / 10
    assert stacked["operators"] < single["operators"]
    assert stacked["host_reads_kept_on_device"] == 0  # the accelerator's rule: none
    # launches follow the 6 distinct shapes, where per layer they follow the 74
    assert stacked["launches_kept_on_device"] < single["launches_kept_on_device"] / 3
    # a factor step folds all 148 factors at once: fewer launches than layers;
    # one scalar read, the step's validity
    assert stacked["factor_step_launches"] < layers
    assert stacked["factor_step_host_reads"] == 1
    assert all(r["result"]["median_ms"] > 0 for r in arms.values())


def test_step_launches_times_non_factor_steps_alone(tmp_path: Path) -> None:
    """Each non-factor step timed on its own (the median), and ``step()``'s own
    host time; only the arms that call ``step()`` spend time in it."""
    records = run("step-launches", tmp_path)
    arms = costs.launches.by_model(records)["mlp"]
    assert set(arms) == {"first-order", "kaisa stacked", "kaisa per layer"}
    assert all(r["result"]["non_factor_ms"] > 0 for r in arms.values())
    assert arms["first-order"]["result"]["step_host_ms_non_factor"] == 0
    assert arms["kaisa stacked"]["result"]["step_host_ms_non_factor"] > 0
    render("step-launches", records, tmp_path)


def test_step_breakdown_splits_every_arms_step_and_replays(tmp_path: Path) -> None:
    """Every arm's non-factor step split into host parts and the device wait;
    the replayed arms replayed, and their ``step()`` is a small part of the
    eager one, whose products run on the CPU."""
    records = run("step-breakdown", tmp_path)
    arms = costs.breakdown.by_model(records)["mlp"]
    assert set(arms) == set(costs.breakdown.ARMS)
    for r in arms.values():
        parts = r["result"]["ms"]
        assert set(parts) == set(costs.breakdown.PARTS)
        assert parts["step"] >= parts["forward+backward"] > 0
    ms = {name: r["result"]["ms"]["precond.step"] for name, r in arms.items()}
    assert ms["kaisa"] > 10 * ms["hooks only"]
    assert 0 < ms["kaisa, replayed"] < ms["kaisa"] / 5
    for name in ("kaisa, replayed", "kaisa, replayed, hooks off"):
        assert arms[name]["result"]["paths"] == {"replayed": 3}, name
    assert arms["kaisa"]["result"]["paths"] == {"non-factor": 3}
    assert arms["kaisa"]["config"]["layers"] == 3
    render("step-breakdown", records, tmp_path)


def test_plan_accuracy_splits_the_overhead_by_stage(tmp_path: Path) -> None:
    records = run("plan-accuracy", tmp_path)
    (r,) = records
    res = r["result"]
    stages = res["stages"]
    assert set(stages) == {*costs.plan_accuracy.STAGES, "rest"}
    measured = sum(s["measured_ms"] for s in stages.values())
    assert measured == pytest.approx(res["measured_overhead_ms"])
    predicted = sum(s["predicted_ms"] for s in stages.values())
    assert predicted == pytest.approx(res["predicted_overhead_ms"], rel=1e-6)
    assert res["predicted_step_ms"] == pytest.approx(res["sgd_ms"] + res["predicted_overhead_ms"])
    for name in ("reduce + fold", "decomposition", "application"):
        assert stages[name]["measured_ms"] > 0 and stages[name]["predicted_ms"] > 0, name
    render("plan-accuracy", records, tmp_path)


def test_the_cases_read_nothing_private_of_the_library() -> None:
    """The cases go through kaisa's public API (``precond.profile``,
    ``stacking``, ``read_scalars``, ``hooks_off``, ``compile(recorder=)``)."""
    for module in (costs.stages, costs.launches, costs.breakdown, costs.plan_accuracy):
        source = Path(module.__file__ or "").read_text()
        assert not re.search(r"\.(_parts|_profile|_handles)\b|precond\._", source), module
