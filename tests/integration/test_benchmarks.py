"""``benchmarks/stages.py --quick``, ``task_steps.py`` and ``step_time.py``'s filters
run and their JSON is complete and consistent.

No assertion on speed: the machine is shared.  What is checked is that every
stage is there with its floor, that every timed stage was actually timed (a
wrapper that kaisa stopped calling would read 0), and that the stages add up
to about the K-FAC overhead measured independently (the K-FAC model's step
time less its plain twin's), so a stage dropped from the split shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXED = (
    "capture: hooks and sums",
    "running average",
    "decomposition",
    "preconditioning products",
    "KL clip + write-back",
    "step() bookkeeping",
)
NO_FLOOR = {"capture: hooks and sums", "step() bookkeeping"}  # bookkeeping: no kernel


def run_script(script: str, *args: str, timeout: int = 180) -> None:
    """``benchmarks/<script>`` in a subprocess on this tree's ``src``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def run_stages(tmp_path: Path, *args: str, timeout: int = 120) -> None:
    """``benchmarks/stages.py`` in a subprocess, writing to ``tmp_path``."""
    run_script("stages.py", *args, "--threads", "1", "--out", str(tmp_path), timeout=timeout)


def test_stages_quick_json_has_every_stage_with_a_floor(tmp_path: Path) -> None:
    run_stages(tmp_path, "--quick")
    data = json.loads((tmp_path / "stages.json").read_text())
    runs = data["runs"]
    assert {(r["method"], r["factor_steps"], r["inv_steps"]) for r in runs} == {
        ("eigen", 1, 10),
        ("eigen", 10, 100),
        ("inverse", 1, 10),
        ("inverse", 10, 100),
    }
    stage_sums, overheads = 0.0, 0.0
    for run in runs:
        stages = {st["stage"]: st for st in run["stages"]}
        for part in ("A rows", "A Gram", "G Gram"):
            assert f"capture: {part} (Linear)" in stages, sorted(stages)
        assert set(FIXED) <= set(stages), sorted(stages)
        for name, st in stages.items():
            assert st["ms"] > 0, (run["method"], name, st)
            assert st["floor_ms"] >= 0, (name, st)
            if name not in NO_FLOOR:
                assert st["floor_ms"] > 0 and st["ratio"] > 0, (name, st)
                assert st["calls"] > 0, (name, st)
            # the cold floor is the floor itself except for the memory-bound stages
            if name in ("running average", "KL clip + write-back"):
                assert st["cold_floor_ms"] > 0, (name, st)
            else:
                assert st["cold_floor_ms"] == st["floor_ms"], (name, st)
        total = sum(st["ms"] for st in stages.values())
        assert abs(total - run["stage_sum_ms"]) < 1e-6
        cold_total = sum(st["cold_floor_ms"] for st in stages.values())
        assert abs(cold_total - run["cold_floor_sum_ms"]) < 1e-9
        assert run["overhead_over_cold_floor"] == pytest.approx(total / cold_total)
        # every timer sits inside the K-FAC model's step
        assert run["stage_sum_ms"] <= run["kfac_step_ms"]
        stage_sums += run["stage_sum_ms"]
        overheads += run["overhead_ms"]
    # summed over the settings, so one noisy window does not decide
    assert 0.4 * overheads <= stage_sums <= 2.5 * overheads, (stage_sums, overheads)
    assert (tmp_path / "stages.png").exists()


def test_stages_conv_capture_is_one_stage_with_the_gram_in_its_floor(tmp_path: Path) -> None:
    """A convolution builds its patch rows inside the Gram: one stage, whose floor
    is a copy of the rows plus their Gram, so it is within a small factor of it
    (charged as an Embedding's count, it read 35x)."""
    run_stages(tmp_path, "--models", "digits-cnn", "--steps", "2", timeout=240)
    for run in json.loads((tmp_path / "stages.json").read_text())["runs"]:
        stages = {st["stage"]: st for st in run["stages"]}
        conv = stages["capture: A rows + Gram (Conv2d)"]
        assert "capture: A Gram (Conv2d)" not in stages and "capture: A rows (Conv2d)" not in stages
        assert conv["calls"] > 0 and 0.3 < conv["ratio"] < 10, conv


# -- benchmarks/task_steps.py and step_time.py's filters: every figure measured --------


def test_task_steps_before_and_after_measures_every_figure(tmp_path: Path) -> None:
    # this tree as its own "before": both labels, each from its own process
    run_script("task_steps.py", "--tasks", "digits-mlp", "--steps", "20", "--rounds", "1",
        "--before", str(ROOT), "--out", str(tmp_path))  # fmt: skip
    data = json.loads((tmp_path / "task_steps.json").read_text())
    assert set(data["medians"]) == {"before", "after"}
    for label in ("before", "after"):
        (run_figures,) = data["runs"][label]
        row = run_figures["digits-mlp"]
        assert set(row) == {"first-order", "K-FAC, mean", "step(), plain step", "floor"}
        assert all(value > 0 for value in row.values())
        # a K-FAC step contains a first-order step and step(): it cannot cost less
        assert row["K-FAC, mean"] > row["step(), plain step"]
    assert (tmp_path / "task_steps.png").stat().st_size > 0


def test_task_steps_floor_counts_every_registered_layer() -> None:
    """Conv1d layers and embeddings too (the floor once saw only Linear and Conv2d)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import task_steps
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from kaisa_lab.tasks import get_task

    blocks = task_steps.floor_blocks(get_task("text-cnn").build_model())
    shapes = sorted((tuple(g.shape), tuple(a.shape), tuple(grad.shape)) for g, a, grad in blocks)
    conv = ((256, 256), (385, 385), (256, 385))  # width-3 Conv1d 128 -> 256, bias column
    proj = ((128, 128), (257, 257), (128, 257))  # 1x1 Conv1d 256 -> 128
    embedding = ((128, 128), (103,), (128, 103))  # A diagonal: one-hot inputs
    head = ((103, 103), (129, 129), (103, 129))
    assert shapes == sorted([conv] * 4 + [proj] * 4 + [embedding, head])


def test_step_time_times_only_the_chosen_models_and_variants(tmp_path: Path) -> None:
    run_script("step_time.py", "--models", "mlp-784-512-512-10", "--variants", "kfac inverse f=1 inv=10",
        "--steps", "2", "--repeats", "1", "--batch", "16", "--out", str(tmp_path))  # fmt: skip
    data = json.loads((tmp_path / "step_time.json").read_text())
    (row,) = data["rows"]
    assert (row["model"], row["variant"]) == ("mlp-784-512-512-10", "kfac inverse f=1 inv=10")
    assert row["step_ms"] > 0 and row["page_faults_per_step"] >= 0
    assert row["ratio_to_sgd"] is None  # no SGD row was timed to divide by
    assert data["meta"]["allocator"] in {"glibc, thresholds raised", "default"}


def test_stages_ab_summarises_medians_over_rounds(tmp_path: Path) -> None:
    """``stages_ab.py --summarise`` on runs written here: medians per tree, setting
    and stage over the rounds, in the order ``stages.py`` ran the settings."""

    def run(method: str, ratio: float, wb: float) -> dict[str, object]:
        stages = [
            {"stage": "preconditioning products", "ms": 10.0},
            {"stage": "KL clip + write-back", "ms": wb},
        ]
        return {
            "method": method,
            "factor_steps": 1,
            "inv_steps": 10,
            "overhead_ms": 10.0 * ratio,
            "floor_sum_ms": 10.0,
            "overhead_over_floor": ratio,
            "stages": stages,
        }

    rounds = {"before": [(1.3, 2.0), (1.2, 1.0), (1.5, 3.0)], "after": [(1.1, 0.5), (1.0, 0.7)]}
    for tree, values in rounds.items():
        for i, (ratio, wb) in enumerate(values, 1):
            folder = tmp_path / f"{tree}-mlp-{i}"
            folder.mkdir()
            runs = [run("eigen", ratio, wb), run("inverse", ratio + 1, wb)]
            (folder / "stages.json").write_text(json.dumps({"runs": runs}))
    run_script("stages_ab.py", "--summarise", "--models", "mlp", "--out", str(tmp_path))
    table = json.loads((tmp_path / "stages_ab.json").read_text())["mlp"]
    assert [row["setting"] for row in table] == ["eigen f=1 inv=10", "inverse f=1 inv=10"]
    eigen, inverse = table
    assert eigen["before"]["ratio"] == 1.3 and eigen["after"]["ratio"] == 1.05
    assert inverse["before"]["ratio"] == 2.3
    assert eigen["before"]["stages_ms"]["KL clip + write-back"] == 2.0
    assert eigen["after"]["stages_ms"]["KL clip + write-back"] == pytest.approx(0.6)
    assert eigen["rounds"]["before"] == [1.3, 1.2, 1.5]
    assert (tmp_path / "stages_ab.png").exists()


def test_step_time_ab_interleaves_two_trees_and_reports_medians(tmp_path: Path) -> None:
    # the same tree on both sides: every row is there, with a sample per round
    run_script(
        "step_time_ab.py",
        "--before",
        str(ROOT),
        "--after",
        str(ROOT),
        "--rounds",
        "2",
        "--steps",
        "2",
        "--models",
        "mlp-784-512-512-10",
        "--variants",
        "sgd",
        "kfac f=1 inv=10",
        "--out",
        str(tmp_path),
        timeout=240,
    )
    data = json.loads((tmp_path / "step_time_ab.json").read_text())
    assert [(r["model"], r["variant"]) for r in data["rows"]] == [
        ("mlp-784-512-512-10", "sgd"),
        ("mlp-784-512-512-10", "kfac f=1 inv=10"),
    ]
    for r in data["rows"]:
        assert len(r["before_ms"]) == len(r["after_ms"]) == 2
        assert all(t > 0 for t in r["before_ms"] + r["after_ms"])
        assert abs(r["ratio"] - r["after_median_ms"] / r["before_median_ms"]) < 1e-12
    assert (tmp_path / "step_time_ab.png").stat().st_size > 0


def test_compile_step_counts_one_graph_per_forward_with_kaisa(tmp_path: Path) -> None:
    # the graph counts only (aot_eager, no inductor build): the issue-24 table's left half
    run_script(
        "compile_step.py", "--graphs-only", "--models", "cnn", "mha-2x128", "--out", str(tmp_path)
    )
    data = json.loads((tmp_path / "compile_step.json").read_text())
    for row in data["results"]:
        plain, kaisa = row["graphs"]["plain"], row["graphs"]["kaisa"]
        assert plain["graphs_factor_step"] == kaisa["graphs_factor_step"] == 1
        assert kaisa["graphs_other_step"] == 1 and kaisa["breaks"] == 0
        assert kaisa["compiled"] == 2  # the factor-step and the other variant
        assert kaisa["captured"] == kaisa["layers"] > 0  # attention projections included


def test_step_launches_counts_fewer_products_when_stacked(tmp_path: Path) -> None:
    run_script(
        "step_launches.py",
        *("--models", "lm-12x64", "--batch", "2", "--rounds", "1", "--block", "1"),
        *("--factor-steps", "2", "--no-compiled", "--out", str(tmp_path)),
        timeout=300,
    )
    (row,) = json.loads((tmp_path / "step_launches.json").read_text())["results"]
    stacked, single = row["step_ops"]["kaisa stacked"], row["step_ops"]["kaisa per layer"]
    assert row["layers"] == 74
    # 12 identical blocks: the products follow the shapes, not the 74 layers
    assert stacked["products"] < single["products"] / 10
    assert stacked["operators"] < single["operators"]
    assert stacked["host_reads_kept_on_device"] == 0  # the accelerator's rule: none
    # 12 blocks: launches follow the 6 distinct shapes, where per layer they follow the 74
    assert stacked["launches_kept_on_device"] < single["launches_kept_on_device"] / 3
    # a factor step folds all 148 factors at once: fewer launches than layers
    # (ten per factor before); one scalar read, the step's validity (the
    # fold's verdicts come with one tolist(), which the profiler does not
    # count on CPU; a read per factor before)
    assert stacked["factor_step_launches"] < row["layers"]
    assert stacked["factor_step_host_reads"] == 1
    assert all(t > 0 for t in row["ms_per_step"].values())
    assert (tmp_path / "step_launches.png").stat().st_size > 0


def test_step_launches_times_non_factor_steps_alone(tmp_path: Path) -> None:
    """The issue's GPU measure: each non-factor step timed on its own (the
    median), and ``step()``'s own host time; NaN-free once one is timed."""
    run_script(
        "step_launches.py",
        *("--models", "mlp", "--batch", "2", "--rounds", "2", "--block", "3"),
        *("--factor-steps", "3", "--no-compiled", "--out", str(tmp_path)),
        timeout=300,
    )
    (row,) = json.loads((tmp_path / "step_launches.json").read_text())["results"]
    plain, host = row["ms_per_non_factor_step"], row["step_host_ms_non_factor"]
    assert set(plain) == set(host) == {"first-order", "kaisa stacked", "kaisa per layer"}
    assert all(t > 0 for t in plain.values())
    assert host["first-order"] == 0 and host["kaisa stacked"] > 0


def test_step_breakdown_splits_every_arms_step_into_its_parts(tmp_path: Path) -> None:
    """step_breakdown.py: every arm's non-factor step split into host parts
    and the device wait; only the arms that call ``step()`` spend time in it."""
    run_script(
        "step_breakdown.py",
        *("--models", "mlp", "--batch", "2", "--rounds", "2", "--block", "3", "--warmup", "2"),
        *("--out", str(tmp_path)),
        timeout=300,
    )
    (row,) = json.loads((tmp_path / "step_breakdown.json").read_text())["results"]
    ms = row["ms"]
    assert set(ms) == {"first-order", "hooks only", "kaisa", "kaisa, hooks off"}
    for parts in ms.values():
        assert set(parts) == {
            "step",
            "forward+backward",
            "precond.step",
            "optimizer",
            "device wait",
        }
        assert parts["step"] >= parts["forward+backward"] > 0
    assert ms["kaisa"]["precond.step"] > 10 * ms["hooks only"]["precond.step"]
    assert (tmp_path / "step_breakdown.png").stat().st_size > 0


def test_replay_host_times_the_host_part_of_a_replayed_step(tmp_path: Path) -> None:
    """replay_host.py: the replayed step's host part (the graph a no-op) is a
    small fraction of the eager step, whose products run on CPU."""
    run_script("replay_host.py", "--models", "mlp", "--steps", "5", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "replay_host.json").read_text())["results"]
    assert row["layers"] == 3
    assert 0 < row["replayed_us"] < row["eager_us"] / 5
    assert (tmp_path / "replay_host.png").stat().st_size > 0


def test_arm_step_cost_builds_kfac_at_the_library_defaults_or_given_keywords(
    tmp_path: Path,
) -> None:
    # the K-FAC arm is timed at what was asked for: the task's settings, the library's
    # defaults (KFACConfig) or either updated by --kfac-kwargs; the JSON says which
    common = ("--task", "text-lm", "--arms", "adamw+kfac", "--rounds", "1", "--block", "1")
    common += ("--warmup", "1")
    run_script("arm_step_cost.py", *common, "--json", str(tmp_path / "task.json"))
    run_script(
        "arm_step_cost.py",
        *common,
        *("--kfac-defaults", "--kfac-kwargs", "damping=0.7,kl_clip=none"),
        *("--json", str(tmp_path / "lib.json")),
    )
    task = json.loads((tmp_path / "task.json").read_text())["kfac_config"]["adamw+kfac"]
    lib = json.loads((tmp_path / "lib.json").read_text())["kfac_config"]["adamw+kfac"]
    assert task["inv_update_steps"] == 50 and task["damping"] == 0.1  # text-lm's K-FAC
    # the library's defaults (AlgorithmConfig: inverse, 10/100, KL clip 1e-3), not text-lm's
    assert lib["inv_update_steps"] == 100 and lib["compute_method"] == "inverse"
    assert lib["damping"] == 0.7 and lib["kl_clip"] is None
    assert lib["loss_average"] == task["loss_average"]  # the task's loss, either way


def test_arm_step_cost_rejects_an_unknown_kfac_keyword() -> None:
    with pytest.raises(subprocess.CalledProcessError) as err:
        run_script("arm_step_cost.py", "--kfac-kwargs", "dampnig=0.3", "--arms", "adamw")
    assert "dampnig" in err.value.stderr and "damping" in err.value.stderr
