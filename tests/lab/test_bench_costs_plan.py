"""The planner and communication cost cases: plan-paper, plan-scale, strategies,
tensor-parallel-comm (kaisa_lab.bench.costs).

The deterministic ones (plans, bytes, memory, modelled times) are checked for
drift: a quick run's rows must equal the committed records under
benchmarks/records, field for field (``TimingCase.deterministic``), so the
docs' tables, rendered from those records (``kaisa bench report``), cannot
go stale.  When a change to the library moves a number on purpose, re-run
the case (``kaisa bench run CASE``) and commit its records.

They run at kaisa's own defaults, as the whole suite does and ``kaisa bench
run`` does.
"""

from __future__ import annotations

import difflib
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.timing import TIMING_CASES, TimingCase, latest
from kaisa_lab.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "records"


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-9 relative (the arithmetic is the same; a JSON float
    round-trips exactly, a platform's last bit may not)."""
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, int | float)
            and isinstance(b, int | float)
            and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _exact(case: TimingCase, record: Mapping[str, Any]) -> dict[str, Any]:
    """What of a record a re-run must reproduce: its configuration (without the
    options of the run: a quick run's arms are a subset of a full run's) and the
    case's deterministic result fields."""
    config = {k: v for k, v in record["config"].items() if k != "options"}
    result = {k: record["result"][k] for k in case.deterministic if k in record["result"]}
    return {"config": config, "result": result}


def drift(case: TimingCase, fresh_root: Path, committed_root: Path = COMMITTED) -> list[str]:
    """How the newest records of ``case`` under ``fresh_root`` differ from the
    newest committed ones, arm by arm (a diff each; empty: none)."""
    committed = {r["arm"]: r for r in latest(RecordStore(committed_root), case.name)}
    problems = []
    for record in latest(RecordStore(fresh_root), case.name):
        arm = record["arm"]
        if arm not in committed:
            problems.append(
                f"{case.name}: arm {arm!r} has no committed record under {committed_root}"
            )
            continue
        have, want = _exact(case, committed[arm]), _exact(case, record)
        if not _same(have, want):
            diff = difflib.unified_diff(
                json.dumps(have, indent=1, sort_keys=True).splitlines(),
                json.dumps(want, indent=1, sort_keys=True).splitlines(),
                f"{arm} (committed)",
                f"{arm} (this tree)",
                lineterm="",
            )
            problems.append("\n".join(diff))
    return problems


def run_quick(name: str, root: Path) -> list[dict[str, Any]]:
    assert main(["bench", "run", name, "--quick", "--records", str(root)]) == 0
    records = latest(RecordStore(root), name)
    assert records, f"{name} wrote no records"
    return records


def assert_no_drift(name: str, root: Path) -> None:
    problems = drift(TIMING_CASES[name], root)
    assert not problems, (
        f"{name} no longer reproduces its committed records (benchmarks/records/{name}); "
        f"if the change is intended, run `kaisa bench run {name}` and commit them:\n"
        + "\n\n".join(problems)
    )


# -- drift: quick runs against the committed records -----------------------------------


def test_plan_paper_reproduces_its_committed_records(tmp_path: Path) -> None:
    records = run_quick("plan-paper", tmp_path)
    case = TIMING_CASES["plan-paper"]
    assert {r["arm"] for r in records} == {
        "resnet50 4gpn_25gbit W=8",
        "resnet50 4gpn_25gbit W=64",
        "resnet50 4gpn_25gbit W=64 every fraction",
    }
    at64 = next(r for r in records if r["arm"] == "resnet50 4gpn_25gbit W=64")["result"]
    assert [f["grad_worker_fraction"] for f in at64["fractions"]] == [1 / 64, 1 / 8, 0.25, 0.5, 1]
    assert at64["layers"] == 54  # 53 convolutions and the classifier
    assert case.tables["resnet50-stages"](records).startswith("| f | capture |")
    assert_no_drift("plan-paper", tmp_path)


@pytest.mark.distributed
def test_strategies_reproduces_its_committed_records(tmp_path: Path) -> None:
    records = run_quick("strategies", tmp_path)
    by_arm = {r["arm"]: r["result"] for r in records}
    assert set(by_arm) == {"W=2 f=1", "W=2 f=1/2", "W=2 reduce vs all_reduce"}
    comm, mem = by_arm["W=2 f=1"], by_arm["W=2 f=1/2"]
    assert (comm["grad_workers"], mem["grad_workers"]) == (2, 1)
    # COMM-OPT holds every second-order tensor, MEM-OPT about half; factors are
    # reduced to their owner, so no rank holds the all-reduced payload
    assert mem["memory"]["second_order"] < comm["memory"]["second_order"]
    assert comm["memory"]["factors"] < comm["factor_bytes_if_allreduced"]
    # COMM-OPT broadcasts second-order tensors on inverse steps only; MEM-OPT
    # broadcasts gradients every step
    assert sum(comm["bytes_inverse_step"].values()) > sum(comm["bytes_plain_step"].values())
    assert sum(mem["bytes_inverse_step"].values()) == sum(mem["bytes_plain_step"].values())
    assert all(r["result"]["step_time_s"] > 0 for r in records if "f=" in r["arm"])
    assert_no_drift("strategies", tmp_path)


@pytest.mark.distributed
def test_tensor_parallel_comm_reproduces_its_committed_records(tmp_path: Path) -> None:
    records = run_quick("tensor-parallel-comm", tmp_path)
    by_config = {r["config"]["configuration"]: r["result"] for r in records}
    assert set(by_config) == {
        "GPT-NeoX (formula)",
        "kaisa exact, f=1",
        "kaisa exact, f=0.5",
        "kaisa block, f=1",
    }
    # block mode moves nothing over the tp group; exact mode gathers less than
    # GPT-NeoX's all-gathers on a factor step
    assert by_config["kaisa block, f=1"]["factor_step_tp"] == 0
    exact = by_config["kaisa exact, f=1"]["factor_step_tp"]
    assert 0 < exact < by_config["GPT-NeoX (formula)"]["factor_step_tp"]
    assert_no_drift("tensor-parallel-comm", tmp_path)


def test_the_drift_check_reports_a_changed_number_with_a_diff(tmp_path: Path) -> None:
    """A committed number that the code no longer produces fails, naming the arm."""
    case = TIMING_CASES["tensor-parallel-comm"]
    fresh = tmp_path / "fresh"
    shutil.copytree(COMMITTED / case.name, fresh / case.name)
    assert drift(case, fresh) == []
    path = next((fresh / case.name).glob("*/*.json"))
    record = json.loads(path.read_text())
    record["result"]["step_tp"] += 4
    path.write_text(json.dumps(record))
    (problem,) = drift(case, fresh)
    assert record["arm"] in problem and '"step_tp"' in problem
    assert drift(case, fresh, committed_root=tmp_path / "none") != []


# -- the timed case and the options ---------------------------------------------------


def test_plan_scale_plans_every_strategy_compactly(tmp_path: Path) -> None:
    """At L layers and W ranks the plan's report stays short (it summarises) and
    every figure was timed (no drift check: the times depend on the machine)."""
    records = run_quick("plan-scale", tmp_path)
    world = TIMING_CASES["plan-scale"].quick["world"]
    assert {r["config"]["grad_worker_fraction"] for r in records} == {1.0, 0.5, 1 / world}
    for r in records:
        assert r["result"]["describe_lines"] < 100
        assert r["result"]["make_plan_s"] > 0 and r["result"]["step_lookups_ms"] > 0
    table = TIMING_CASES["plan-scale"].tables["scale"](records)
    assert "| 1 (COMM-OPT) |" in table and f"| 1/{world} (MEM-OPT) |" in table


def test_strategies_refuses_too_few_steps() -> None:
    with pytest.raises(ValueError, match="steps must exceed inv_update_steps"):
        TIMING_CASES["strategies"].measure(
            TIMING_CASES["strategies"].resolve({"steps": 4}, quick=True)
        )
