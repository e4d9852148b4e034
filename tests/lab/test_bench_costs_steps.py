"""The step-cost cases: step-cost, task-step-cost, precision, conv-capture and
compile-step (kaisa_lab.bench.costs).

No assertion on speed (the machine is shared): each case runs with its quick
options through ``kaisa bench run CASE --quick``, and what is checked is that
every arm was measured, that the records hold what the tables need, and that
the tables render from the records alone. The deterministic results (the
precision's second-order memory, compile-step's graph counts) must equal the
committed records under benchmarks/records, which the docs render: when a
change moves one on purpose, re-run the case and commit its records.

They run at kaisa's own defaults, as the whole suite does and ``kaisa bench
run`` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kaisa_lab.bench.records import SCHEMA, RecordStore
from kaisa_lab.bench.timing import TIMING_CASES, latest
from kaisa_lab.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "records"


def run_quick(name: str, root: Path, *options: str) -> list[dict[str, Any]]:
    """``kaisa bench run NAME --quick`` (plus ``--option`` each) into ``root``: its records."""
    extra = [f"--option={o}" for o in options]
    assert main(["bench", "run", name, "--quick", "--records", str(root), *extra]) == 0
    records = latest(RecordStore(root), name)
    assert records, f"{name} wrote no records"
    assert {r["schema"] for r in records} == {SCHEMA}
    assert {r["kind"] for r in records} == {"timing"}
    return records


def assert_plots(name: str, root: Path) -> None:
    """``kaisa bench report NAME --plot`` draws a PNG from the records under ``root``."""
    png = root / f"{name}.png"
    assert main(["bench", "report", name, "--records", str(root), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0


def timed(result: Mapping[str, Any]) -> bool:
    """Every step of the arm was timed (a wrapper never called would read 0)."""
    return result["median_ms"] > 0 and result["mean_ms"] > 0 and result["count"] >= 1


def assert_as_committed(name: str, records: list[dict[str, Any]]) -> None:
    """The deterministic fields of ``records`` equal the newest committed records of
    the same arms (same configuration, the run's options aside)."""
    case = TIMING_CASES[name]
    committed = {r["arm"]: r for r in latest(RecordStore(COMMITTED), name)}
    assert committed, f"no committed records of {name} under {COMMITTED}"
    checked = 0
    for record in records:
        fields = [k for k in case.deterministic if k in record["result"]]
        if not fields:
            continue
        want = committed.get(record["arm"])
        assert want is not None, f"{name}: arm {record['arm']!r} has no committed record"
        strip = lambda c: {k: v for k, v in c.items() if k != "options"}  # noqa: E731
        assert strip(record["config"]) == strip(want["config"]), record["arm"]
        for field in fields:
            assert record["result"][field] == want["result"][field], (
                f"{name} {record['arm']}: {field} is {record['result'][field]}, committed "
                f"{want['result'][field]}; if intended, `kaisa bench run {name}` and commit"
            )
            checked += 1
    assert checked, f"{name}: no deterministic field was compared"


# -- step-cost ------------------------------------------------------------------------


def test_step_cost_times_every_arm_in_turns(tmp_path: Path) -> None:
    from kaisa_lab.bench.costs.steps import default_reference_src

    records = run_quick("step-cost", tmp_path)
    case = TIMING_CASES["step-cost"]
    (model,) = case.quick["models"]
    variants = case.quick["variants"]
    want = {f"{model} {v}" for v in variants}
    if default_reference_src() is not None:  # kfac-pytorch beside every K-FAC variant
        want |= {f"{model} {v} (kfac-pytorch)" for v in variants if v != "sgd"}
    assert {r["arm"] for r in records} == want
    for r in records:
        assert timed(r["result"]) and r["result"]["page_faults_per_step"] >= 0
        assert r["config"]["allocator"] in {"glibc, thresholds raised", "default"}
    sgd = next(r for r in records if r["config"]["variant"] == "sgd")
    assert sgd["config"]["library"] == "torch" and sgd["config"]["kfac"] is None
    ratio = case.tables["ratio"](records)
    assert ratio.startswith("| model | variant | library |")
    assert f"| {model} | sgd | torch |" in ratio and "| 1.00 |" in ratio
    reference = case.tables["reference"](records)
    if default_reference_src() is not None:
        assert "| kfac inverse f=1 inv=10 |" in reference
    assert_plots("step-cost", tmp_path)


def test_step_cost_times_only_the_chosen_variants(tmp_path: Path) -> None:
    records = run_quick(
        "step-cost", tmp_path, 'variants=["kfac inverse f=1 inv=10"]', "reference_src=null"
    )
    (record,) = records
    assert record["config"]["variant"] == "kfac inverse f=1 inv=10"
    assert "| - |" in TIMING_CASES["step-cost"].tables["ratio"](records)  # no SGD to divide by
    assert "no kfac-pytorch arm" in TIMING_CASES["step-cost"].tables["reference"](records)


@pytest.mark.parametrize(
    "variant",
    ["kfac eigen f=10 inv=100 replayed", "kfac eigen f=10 inv=100 read", "sgd fused"],
)
def test_step_cost_refuses_the_accelerators_variants_off_cuda(variant: str) -> None:
    from kaisa_lab.bench.costs.steps import CUDA_ONLY, _variants

    case = TIMING_CASES["step-cost"]
    options = case.resolve({"variants": [variant]}, quick=True)
    with pytest.raises(ValueError, match="need device=cuda"):
        case.measure(options)
    everything = _variants(case.resolve({"variants": None}, quick=True))
    assert everything and not set(everything) & CUDA_ONLY


def test_ab_times_step_cost_on_two_trees(tmp_path: Path) -> None:
    """``kaisa bench ab step-cost --quick``: the same tree on both sides, every arm
    with a sample per round (two fresh processes a round)."""
    from kaisa_lab.bench.ab import ab

    arguments = ["--quick", "--option=reference_src=null"]
    records = ab("step-cost", str(ROOT), rounds=1, arguments=arguments)
    variants = TIMING_CASES["step-cost"].quick["variants"]
    assert len(records) == len(variants)
    for r in records:
        assert len(r["result"]["before_rounds_ms"]) == len(r["result"]["after_rounds_ms"]) == 1


# -- task-step-cost -------------------------------------------------------------------


def test_task_step_cost_measures_every_arm_step_and_floor(tmp_path: Path) -> None:
    records = run_quick("task-step-cost", tmp_path)
    by_arm = {r["config"]["arm"]: r for r in records}
    assert set(by_arm) == {"sgd", "sgd+kfac", "floor"}  # digits-mlp: SGD, then + K-FAC
    for r in records:
        assert timed(r["result"])
    first, kfac = by_arm["sgd"]["result"], by_arm["sgd+kfac"]["result"]
    assert first["cpu_ms"] > 0 and kfac["cpu_ms"] > 0
    assert "step_call_mean_ms" not in first and by_arm["sgd"]["config"]["kfac"] is None
    # a K-FAC step holds a first-order step and step(): it cannot cost less than step()
    assert kfac["mean_ms"] > kfac["step_call_mean_ms"] > 0
    assert kfac["step_call_plain_ms"] is not None and kfac["step_call_plain_ms"] > 0
    table = TIMING_CASES["task-step-cost"].tables["cost"](records)
    rows = [line for line in table.splitlines() if line.startswith("| digits-mlp")]
    assert [row.split(" | ")[1] for row in rows][:2] == ["sgd", "sgd+kfac"]  # as measured
    assert "floor" in rows[2]
    assert_plots("task-step-cost", tmp_path)


def test_task_step_cost_builds_kfac_at_the_task_settings_or_the_library_defaults(
    tmp_path: Path,
) -> None:
    from kaisa.config import KFACConfig
    from kaisa_lab.tasks import get_task

    task = get_task("digits-mlp")
    common = ("rounds=1", "block=1", "floor=false", 'arms=["sgd+kfac"]')
    (at_task,) = run_quick("task-step-cost", tmp_path / "task", *common)
    settings = at_task["config"]["kfac"]
    for key, value in task.kfac_for("sgd").items():  # the suite's selection, if any
        assert settings[key] == value
    (lib,) = run_quick(
        "task-step-cost", tmp_path / "lib", *common, "kfac=defaults",
        "kfac_kwargs=damping=0.7,kl_clip=none",
    )  # fmt: skip
    settings = lib["config"]["kfac"]
    defaults = KFACConfig()
    assert settings["inv_update_steps"] == defaults.inv_update_steps
    assert settings["compute_method"] == str(defaults.compute_method.value)
    assert settings["damping"] == 0.7 and settings["kl_clip"] is None
    assert settings["loss_average"] == task.loss_average  # the task's loss, either way
    assert "| sgd+kfac |" in TIMING_CASES["task-step-cost"].tables["kfac"]([lib])


def test_levers_step_cost_builds_each_arm_with_its_lever(tmp_path: Path) -> None:
    """The levers cases' arms timed as the campaign runs them: K-FAC at the
    library's defaults plus the lever's keywords, its run fields on the step."""
    from kaisa_lab.bench.cases import get_case

    records = run_quick(
        "levers-step-cost", tmp_path, "rounds=1", "block=1",
        'arms=["muon", "muon+kfac", "muon+kfac-lean", "adamw"]',
    )  # fmt: skip
    by_arm = {r["config"]["arm"]: r for r in records}
    # AdamW alone is no arm of the levers case: an optimizer alone is the same everywhere
    assert set(by_arm) == {"muon", "muon+kfac", "muon+kfac-lean", "adamw"}
    assert by_arm["adamw"]["config"]["lever"] == {} and by_arm["adamw"]["config"]["kfac"] is None
    assert all(timed(r["result"]) and r["result"]["cpu_ms"] > 0 for r in records)
    (lean,) = [a for a in get_case("text-lm-levers").arms if a.kind == "muon+kfac-lean"]
    built = by_arm["muon+kfac-lean"]["config"]
    assert built["lever"] == dict(lean.lever)
    for key, value in lean.kfac_lever().items():  # its K-FAC keywords, as built
        assert str(built["kfac"][key]).removeprefix("torch.") == str(value), key
    assert built["kfac"]["factor_position_fraction"] == lean.run_lever()["position_fraction"]
    assert built["muon_ns_steps"] == lean.run_lever()["muon_ns_steps"] == 3  # as stepped
    plain = by_arm["muon+kfac"]["config"]
    assert plain["lever"] == {} and plain["kfac"]["max_factor_dim"] != 129
    assert plain["muon_ns_steps"] == 5 and "muon_ns_steps" not in by_arm["adamw"]["config"]
    table = TIMING_CASES["levers-step-cost"].tables["kfac"](records)
    assert "`muon_ns_steps=3`" in table and "| muon+kfac | " in table
    assert_plots("levers-step-cost", tmp_path)  # the CPU time per step, Muon's as a line
    with pytest.raises(ValueError, match="muon\\+kfac-lean"):
        run_quick("levers-step-cost", tmp_path / "bad", 'arms=["muon+kfac-leaner"]')


def test_task_step_cost_rejects_an_unknown_kfac_keyword(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        main(["bench", "run", "task-step-cost", "--quick", "--records", str(tmp_path),
              "--option", "kfac_kwargs=dampnig=0.3"])  # fmt: skip
    assert "dampnig" in str(err.value) and "damping" in str(err.value)


def test_task_step_cost_floor_counts_every_registered_layer() -> None:
    """Conv1d layers and embeddings too, at the preconditioner's own factor sizes."""
    from kaisa_lab.bench.costs.task_steps import floor_blocks
    from kaisa_lab.tasks import get_task

    blocks = floor_blocks(get_task("text-cnn").build_model())
    shapes = sorted((tuple(g.shape), tuple(a.shape), tuple(grad.shape)) for g, a, grad in blocks)
    conv = ((256, 256), (385, 385), (256, 385))  # width-3 Conv1d 128 -> 256, bias column
    proj = ((128, 128), (257, 257), (128, 257))  # 1x1 Conv1d 256 -> 128
    embedding = ((128, 128), (103,), (128, 103))  # A diagonal: one-hot inputs
    head = ((103, 103), (129, 129), (103, 129))
    assert shapes == sorted([conv] * 4 + [proj] * 4 + [embedding, head])


# -- precision ------------------------------------------------------------------------


def test_precision_measures_every_variant_and_its_memory(tmp_path: Path) -> None:
    from kaisa_lab.bench.costs.precision import VARIANTS

    records = run_quick("precision", tmp_path)
    case = TIMING_CASES["precision"]
    by_variant = {r["config"]["variant"]: r["result"] for r in records}
    assert set(by_variant) == {
        "float32 (default)",
        "preconditioning bf16",
        "Gram bf16",
        "both bf16",
    }
    assert all(timed(res) for res in by_variant.values())
    default, precondition = by_variant["float32 (default)"], by_variant["preconditioning bf16"]
    assert default["max_rel_err_vs_float64"] < 1e-3 < precondition["max_rel_err_vs_float64"]
    assert 0.99 < precondition["min_cosine_vs_float64"] <= 1.0
    # the cached bfloat16 copies: half the bytes of the float32 tensors on top
    assert precondition["second_order_bytes"] == 1.5 * default["second_order_bytes"]
    memory = case.tables["memory"](records).splitlines()
    assert memory[0] == "| model | products in | second-order bytes |"
    assert memory[2].startswith("| MLP 784-512-512-10 | float32 (default) |")
    assert [line.split(" | ")[1] for line in memory[2:]] == list(VARIANTS)  # in their order
    assert case.tables["step"](records).count("\n") == 2 + len(records)
    assert_as_committed("precision", records)


# -- conv-capture ---------------------------------------------------------------------


def test_conv_capture_times_every_term_and_the_step(tmp_path: Path) -> None:
    records = run_quick("conv-capture", tmp_path)
    by_arm = {r["arm"]: r["result"] for r in records}
    terms = {arm for arm in by_arm if arm[:2] in ("A ", "G ")}
    assert terms == {f"{f} {layer}" for f in "AG" for layer in ("0", "2", "5")}  # 3 convs
    assert all(timed(by_arm[arm]) for arm in [*terms, "step f=1 inv=10"])
    for factor, label in (("A", "A, the convs"), ("G", "G, the convs")):
        parts = sum(by_arm[f"{factor} {layer}"]["median_ms"] for layer in ("0", "2", "5"))
        assert math.isclose(by_arm[label]["median_ms"], parts)
    total = by_arm["A, the convs"]["median_ms"] + by_arm["G, the convs"]["median_ms"]
    assert math.isclose(by_arm["capture terms, A + G"]["median_ms"], total)
    table = TIMING_CASES["conv-capture"].tables["capture"](records)
    assert "| A, conv 32→32 (289 wide, 32×32) |" in table
    assert "| step, median (a factor step) |" in table and table.count("\n") == 2 + 11


# -- compile-step ---------------------------------------------------------------------


def test_compile_step_times_four_arms_and_counts_one_graph_per_forward(tmp_path: Path) -> None:
    records = run_quick("compile-step", tmp_path)  # cnn, aot_eager: no inductor build
    by_arm = {r["config"]["arm"]: r["result"] for r in records}
    assert set(by_arm) == {"eager", "eager+kaisa", "compiled", "compiled+kaisa"}
    assert all(timed(res) and res["first_step_s"] > 0 for res in by_arm.values())
    plain, kaisa = by_arm["compiled"], by_arm["compiled+kaisa"]
    assert plain["graphs_factor_step"] == kaisa["graphs_factor_step"] == 1
    assert kaisa["graphs_other_step"] == 1 and kaisa["graph_breaks"] == 0
    assert kaisa["graphs_compiled"] == 2  # the factor-step and the other variant
    assert kaisa["layers_captured"] == kaisa["layers"] == 5
    case = TIMING_CASES["compile-step"]
    assert case.tables["graphs"](records).count("| cnn | 1 | 1 / 1 |") == 1
    assert "| cnn |" in case.tables["time"](records)
    assert_plots("compile-step", tmp_path)
    assert_as_committed("compile-step", records)


def test_compile_step_captures_multihead_attention_in_one_graph(tmp_path: Path) -> None:
    records = run_quick("compile-step", tmp_path, 'models=["mha-2x128"]', "timed=false")
    by_arm = {r["config"]["arm"]: r["result"] for r in records}
    assert set(by_arm) == {"compiled", "compiled+kaisa"}  # the graph counts alone
    kaisa = by_arm["compiled+kaisa"]
    assert kaisa["graphs_factor_step"] == kaisa["graphs_other_step"] == 1
    assert kaisa["graph_breaks"] == 0
    assert kaisa["layers_captured"] == kaisa["layers"] == 14  # attention projections included
    assert "no step times" in TIMING_CASES["compile-step"].tables["time"](records)
    assert_as_committed("compile-step", records)
