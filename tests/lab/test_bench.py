"""The benchmark suite: lockstep runs, the protocol, the campaign, the records, the report.

The tests that guard a comparison's fairness each break the property they
guard and check that it is caught: arms seeded apart, another data order,
evaluation on the clock.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from kaisa_lab.bench import campaign as campaign_module
from kaisa_lab.bench.campaign import Campaign, work
from kaisa_lab.bench.cases import CASES, KFAC_KNOBS, Arm, get_case
from kaisa_lab.bench.protocol import Outcome, Protocol, Setting, best, followup, grid, work_base
from kaisa_lab.bench.records import SCHEMA, RecordStore, config_key
from kaisa_lab.bench.report import lever_verdict, markdown_heldout, markdown_tuning
from kaisa_lab.bench.rows import (
    FairnessError,
    heldout_rows,
    paired_ratio,
    quotient,
    steps_between,
    time_between,
)
from kaisa_lab.cli import trainer as trainer_module
from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.main import main
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.train import train_lockstep, train_run
from kaisa_lab.tasks.registry import get_task

CPU = DistContext(device=torch.device("cpu"))
QUIET = Progress(enabled=False, bars=False)


def _specs(case: str = "quick", seed: int = 0) -> list[Any]:
    c = get_case(case)
    setting = c.grid(c.arms[0])[1]
    return [c.spec(arm, setting, seed) for arm in c.arms[:2]]  # sgd and sgd+kfac


def _strip(result: Any) -> list[tuple[int, float, float]]:
    return [(r.step, r.train_loss, r.metric) for r in result.curve]


# ---------------------------------------------------------------- lockstep


def test_a_run_in_lockstep_is_bit_identical_to_the_run_alone() -> None:
    task = get_task("digits-mlp")
    data = task.load()
    specs = _specs()
    together = train_lockstep(specs, task, data, CPU, QUIET)
    alone = [train_run(spec, task, data, CPU, QUIET) for spec in specs]
    for a, b in zip(together, alone, strict=True):
        assert _strip(a) == _strip(b) and len(a.curve) > 1
        assert (a.steps_to_target, a.stopped) == (b.steps_to_target, b.stopped)


def test_lockstep_keeps_each_runs_random_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that draws random numbers (dropout, sampled labels) draws the same ones
    in a group as alone: each run's generator state is its own."""
    draws: dict[str, list[float]] = {}
    original = trainer_module.Trainer.step

    def step(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kind = "kfac" if self.preconditioner is not None else "sgd"
        draws.setdefault(kind, []).append(float(torch.rand(())))
        return original(self, x, y)

    monkeypatch.setattr(trainer_module.Trainer, "step", step)
    task = get_task("digits-mlp")
    data = task.load()
    specs = [dataclasses.replace(s, epochs=1, stop_at_target=False) for s in _specs()]
    train_lockstep(specs, task, data, CPU, QUIET)
    together = dict(draws)
    draws.clear()
    for spec in specs:
        train_run(spec, task, data, CPU, QUIET)
    assert together == draws and together["sgd"] == together["kfac"]
    assert len(set(together["sgd"])) == len(together["sgd"]) > 1  # a stream, not one draw


def test_evaluation_is_off_every_runs_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that jumps 1000 s during each evaluation must not show in any run's time."""
    from kaisa_lab.cli import train as train_module

    now = [0.0]

    def clock() -> float:
        now[0] += 0.001
        return now[0]

    real = train_module.evaluate

    def slow(*args: Any, **kwargs: Any) -> dict[str, float]:
        now[0] += 1000.0
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module.time, "perf_counter", clock)
    monkeypatch.setattr(train_module, "evaluate", slow)
    task = get_task("digits-mlp")
    results = train_lockstep(_specs(), task, task.load(), CPU, QUIET)
    for result in results:
        assert len(result.curve) > 1
        assert all(0 < r.wall_time_s < 5.0 for r in result.curve), result.curve


def test_evaluation_records_no_graph_and_leaves_the_model_as_it_found_it() -> None:
    """Every forward of an evaluation runs without autograd (a graph recorded for
    outputs never differentiated would cost a campaign worker time), and the
    model goes back to training mode."""
    from kaisa_lab.cli import train as train_module

    task = get_task("text-lm")
    data = task.load()
    torch.manual_seed(0)
    model = task.build_model()
    modes: list[bool] = []
    model.register_forward_hook(lambda *_: modes.append(torch.is_grad_enabled()))
    scored = train_module.evaluate(model, task, data.test, CPU, 256)
    assert modes and not any(modes)
    assert model.training and torch.is_grad_enabled()
    assert math.isfinite(scored["bits_per_char"])


def test_arms_of_one_seed_share_weights_and_data_order_and_another_seed_does_not() -> None:
    task = get_task("digits-mlp")
    data = task.load()
    seed0 = train_lockstep(_specs(seed=0), task, data, CPU, QUIET)
    seed1 = train_lockstep(_specs(seed=1)[:1], task, data, CPU, QUIET)
    assert seed0[0].initial_weights == seed0[1].initial_weights != seed1[0].initial_weights
    assert seed0[0].data_order == seed0[1].data_order != seed1[0].data_order
    assert len(seed0[0].initial_weights) == 64


def test_cutoff_ends_a_run_and_on_finish_sees_every_run() -> None:
    task = get_task("digits-mlp")
    finished: list[tuple[int, str]] = []
    specs = [dataclasses.replace(s, stop_at_target=False) for s in _specs()]
    results = train_lockstep(
        specs,
        task,
        task.load(),
        CPU,
        QUIET,
        cutoff=lambda i, result: i == 0 and len(result.curve) >= 2,
        on_finish=lambda i, result: finished.append((i, result.stopped)),
    )
    assert results[0].stopped == "cutoff" and len(results[0].curve) == 2
    assert results[1].stopped == "budget"
    assert len(results[1].curve) == specs[1].epochs * specs[1].evals_per_epoch
    assert sorted(finished) == [(0, "cutoff"), (1, "budget")]


# ---------------------------------------------------------------- the protocol


def test_the_grid_is_centred_on_the_prior_times_each_warm_up() -> None:
    settings = grid(Protocol(), 0.01, (0.0, 0.25), "cosine")
    assert [s.lr for s in settings[:5]] == [0.0025, 0.005, 0.01, 0.02, 0.04]
    assert [s.warmup_epochs for s in settings] == [0.0] * 5 + [0.25] * 5
    assert {s.schedule for s in settings} == {"cosine"}


def _o(time_s: float | None, steps: int | None = None, final: float = 1.0) -> Outcome:
    return Outcome(time_s, steps if steps is not None else (None if time_s is None else 10), final)


def test_best_is_the_fewest_median_steps_a_miss_counting_as_infinite() -> None:
    a, b, c = (Setting(lr, 0.0, "cosine") for lr in (0.1, 0.2, 0.4))
    results = {
        a: [_o(1.0, 10), _o(None), _o(None)],  # fewest once, but misses on two seeds
        b: [_o(3.0, 30), _o(2.0, 20), _o(2.5, 25)],
        c: [_o(2.4, 24), _o(2.45, 24), _o(None)],  # misses once: its median is still 24
    }
    assert best(results, higher_is_better=False) == c
    results[c] = [_o(2.4, 24), _o(9.0, 90), _o(None)]
    assert best(results, higher_is_better=False) == b
    # equal median steps: the fewer mean steps, whatever the clocks say
    results[c] = [_o(9.0, 24), _o(9.0, 25), _o(9.0, 40)]
    results[b] = [_o(1.0, 20), _o(1.0, 25), _o(1.0, 60)]
    assert best(results, higher_is_better=False) == c


def test_when_nothing_reaches_the_best_median_final_metric_wins() -> None:
    a, b = Setting(0.1, 0.0, "cosine"), Setting(0.2, 0.0, "cosine")
    results = {a: [_o(None, final=3.0)] * 3, b: [_o(None, final=2.0)] * 3}
    assert best(results, higher_is_better=False) == b
    assert best(results, higher_is_better=True) == a


def test_a_best_at_an_edge_extends_the_grid_beyond_it() -> None:
    p = Protocol()
    settings = grid(p, 0.01, (0.0, 0.25), "cosine")
    top = settings[4]  # lr 0.04, no warm-up
    assert followup(p, settings, top, ()) == Setting(0.08, 0.0, "cosine")
    bottom = settings[5]  # lr 0.0025 with warm-up
    assert followup(p, settings, bottom, KFAC_KNOBS) == Setting(0.00125, 0.25, "cosine")


def test_an_inner_best_refines_the_lr_or_tries_the_arms_knobs() -> None:
    p = Protocol()
    settings = grid(p, 0.01, (0.0, 0.25), "cosine")
    inner = settings[2]
    assert followup(p, settings, inner, ()) == Setting(0.01414, 0.0, "cosine")
    after = followup(p, [*settings, Setting(0.01414, 0.0, "cosine")], inner, ())
    assert after == Setting(0.007071, 0.0, "cosine")
    knob = followup(p, settings, inner, KFAC_KNOBS)
    assert knob == Setting(0.01, 0.0, "cosine", (("inv_update_steps", 50),))
    # a knob variant lies on its lr axis: choosing it does not count as an edge
    assert followup(p, [*settings, knob], knob, KFAC_KNOBS) == Setting(
        0.01, 0.0, "cosine", (("damping", 0.1), ("inv_update_steps", 50))
    )


def test_the_budget_is_the_same_for_every_arm() -> None:
    p = Protocol(budget=10)
    settings = grid(p, 0.01, (0.0, 0.25), "cosine")
    assert followup(p, settings, settings[4], ()) is None
    assert followup(p, settings, settings[2], KFAC_KNOBS) is None


def test_selection_and_held_out_seeds_must_be_disjoint() -> None:
    with pytest.raises(ValueError, match="disjoint"):
        Protocol(selection_seeds=(0, 1), heldout_seeds=(1, 2))


def test_every_case_gives_every_arm_the_same_axes_and_budget() -> None:
    for case in CASES.values():
        sizes = {len(case.grid(arm)) for arm in case.arms}
        assert sizes == {case.protocol.lr_points * len(case.warmups)}, case.name
        assert 0.0 in case.warmups and len(case.warmups) == 2
        for arm in case.arms:
            spec = case.spec(arm, case.grid(arm)[0], 0)
            if arm.kfac:  # the library's defaults: the loss's averaging and a lever's keyword
                averaging = {"loss_average": get_task(case.task).loss_average}
                assert dict(spec.kfac_kwargs) == {**averaging, **arm.kfac_lever()}
                assert bool(arm.kfac_lever()) <= bool(arm.tag)  # a lever is named by its tag


# ---------------------------------------------------------------- campaign and records


def test_a_campaign_runs_the_protocol_to_the_end_and_records_every_run(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    campaign = Campaign(get_case("quick"), store)
    work(campaign, QUIET, wait_s=0)
    campaign.refresh()
    assert campaign.units() == []
    records = list(store.read("quick"))
    assert {r["schema"] for r in records} == {SCHEMA}
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        assert state.stage == "done" and len(state.tried) == campaign.protocol.budget
    heldout = [r for r in records if r["role"] == "heldout"]
    assert {r["seed"] for r in heldout} == set(campaign.protocol.heldout_seeds)
    first = records[0]
    assert first["key"] == config_key(first["config"])
    env = first["environment"]
    assert env["machine"]["cpus"] == os.cpu_count() and env["threads"] >= 1
    assert env["versions"]["torch"] == torch.__version__ and "kaisa" in env["versions"]
    assert env["load_1min"]["start"] is not None and env["date"].startswith("20")
    assert first["curve"] and {"step", "time_s", "metric", "train_loss"} <= set(first["curve"][0])
    rows = heldout_rows(campaign)
    assert [r.arm.name for r in rows] == [a.name for a in campaign.case.arms]
    # every step of a CPU run is timed on the CPU clock too, and the table shows it
    for record in heldout:
        times = record["result"]["step_times"]
        assert times["cpu_median_ms"] > 0 and times["median_ms"] > 0
        cpu = [point["cpu_s"] for point in record["curve"]]
        assert all(c > 0 for c in cpu) and cpu == sorted(cpu)
        if record["result"]["reached"]:  # the CPU clock at the reading that reached
            reached = next(
                p for p in record["curve"] if p["step"] == record["result"]["steps_to_target"]
            )
            assert record["result"]["cpu_time_to_target_s"] == reached["cpu_s"]
    assert all(r.cpu_ms is not None and r.cpu_ms > 0 for r in rows)
    table = markdown_heldout(campaign)
    assert "sgd + K-FAC (library defaults)" in table and "sgd + K-FAC (tuned)" in table
    header, rule, *body = table.splitlines()
    assert "| ms/step | CPU ms/step | CPU time to target (s) |" in header
    assert rule.count("---") == 10
    assert all(len(line.split("|")) == len(header.split("|")) for line in body)
    at = [c.strip() for c in header.split("|")].index("CPU time to target (s)")
    for row, line in zip(rows, body, strict=True):  # a median over misses: not reached
        assert row.cpu_time_s is not None
        want = f"{row.cpu_time_s:.3g}" if math.isfinite(row.cpu_time_s) else "not reached"
        assert line.split("|")[at].strip() == want
    assert "**" in markdown_tuning(campaign)


def test_a_campaign_resumes_without_running_a_recorded_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trained: list[str] = []
    real = campaign_module.train_lockstep

    def counting(specs: Any, *args: Any, **kwargs: Any) -> Any:
        trained.extend(config_key(s.to_dict()) + f"-s{s.seed}" for s in specs)
        return real(specs, *args, **kwargs)

    monkeypatch.setattr(campaign_module, "train_lockstep", counting)
    store = RecordStore(tmp_path)
    assert work(Campaign(get_case("quick"), store), QUIET, max_units=2, wait_s=0) == 2
    first = len(trained)
    work(Campaign(get_case("quick"), store), QUIET, wait_s=0)
    assert len(trained) == len(set(trained)) > first  # nothing twice
    # the two K-FAC arms share their grid: one run serves both
    files = list(tmp_path.glob("quick/*/*.json"))
    assert len(files) == len(trained)


def test_a_unit_held_by_a_live_worker_is_left_to_it(tmp_path: Path) -> None:
    campaign = Campaign(get_case("quick"), RecordStore(tmp_path))
    locks = tmp_path / "quick" / ".locks"
    locks.mkdir(parents=True)
    for unit in campaign.units():
        (locks / f"{unit.name}.lock").write_text(str(os.getpid()))  # this process: alive
    assert work(campaign, QUIET, wait_s=0) == 0
    for lock in locks.iterdir():
        lock.write_text("999999999")  # no such process: a dead worker's lock
    assert work(campaign, QUIET, wait_s=0, max_units=1) == 1


def test_the_report_refuses_arms_that_started_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeding the K-FAC arms differently must not pass unnoticed."""
    original = trainer_module.Trainer.__init__

    def seeded_apart(self: Any, spec: Any, task: Any, ctx: Any) -> None:
        if spec.kfac:
            spec = dataclasses.replace(spec, seed=spec.seed + 100)
        original(self, spec, task, ctx)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", seeded_apart)
    campaign = Campaign(get_case("quick"), RecordStore(tmp_path))
    work(campaign, QUIET, wait_s=0)
    campaign.refresh()
    with pytest.raises(FairnessError, match="held-out seed 1"):
        heldout_rows(campaign)


def test_the_report_refuses_another_data_order(tmp_path: Path) -> None:
    campaign = Campaign(get_case("quick"), RecordStore(tmp_path))
    work(campaign, QUIET, wait_s=0)
    campaign.refresh()
    heldout_rows(campaign)  # fair as run
    path = next(p for p in tmp_path.glob("quick/sgd/*-s2.json"))
    record = json.loads(path.read_text())
    record["result"]["fingerprints"]["data_order"] = "0" * 64
    path.write_text(json.dumps(record))
    campaign.refresh()
    with pytest.raises(FairnessError, match="held-out seed 2"):
        heldout_rows(campaign)


def test_tuning_runs_are_cut_off_but_held_out_runs_are_not(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    case = dataclasses.replace(
        get_case("quick"), protocol=dataclasses.replace(get_case("quick").protocol, cutoff=1.0)
    )
    campaign = Campaign(case, store)
    work(campaign, QUIET, wait_s=0)
    records = list(store.read("quick"))
    stopped = {(r["role"], r["result"]["stopped"]) for r in records}
    assert ("grid", "cutoff") in stopped
    assert all(r["result"]["stopped"] != "cutoff" for r in records if r["role"] == "heldout")
    fewest: dict[tuple[str, int], int] = {}
    for r in records:
        if r["result"]["reached"]:
            at = (r["arm"], r["seed"])
            fewest[at] = min(fewest.get(at, 10**9), r["result"]["steps_to_target"])
    for r in records:  # cut by steps, past the fewest of its kind on its seed
        if r["result"]["stopped"] == "cutoff":
            assert not r["result"]["reached"]
            assert r["result"]["steps"] > fewest[(r["arm"], r["seed"])]


def test_kaisa_bench_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in CASES) and "(quick)" in listed
    records = ["--records", str(tmp_path)]
    assert main(["bench", "run", "quick", *records, "--no-wait"]) == 0
    out = capsys.readouterr().out
    assert "sgd+kfac tuned" in out and "done" in out
    assert main(["bench", "report", "quick", *records, "--plot", str(tmp_path / "q.png")]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| arm | selected setting |")
    assert (tmp_path / "q.png").stat().st_size > 10_000
    assert main(["bench", "status", "quick", *records]) == 0
    with pytest.raises(SystemExit):
        main(["bench", "run", "quick", *records, "--stages", "warmup"])
    assert "argument --stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "run", "quick", *records, "--snapshot-minutes", "-1"])
    assert "argument --snapshot-minutes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run", "quick", "--snapshot-minutes", "nan"], "--snapshot-minutes"),
        (["run", "quick", "--option", "rounds=2"], "--option"),  # a cost case's flags
        (["run", "quick", "--quick"], "--quick"),
        (["run", "quick", "--print-json"], "--print-json"),
        (["run", "quick", "--device", "cuda"], "--device"),  # no CUDA on this build
        (["status", "quick", "--records", "/no/such/folder"], "--records"),
        (["report", "quick", "--records", "/no/such/folder"], "--records"),
        (["summary", "--records", "/no/such/folder"], "--records"),
        (["report", "quick", "--plot", "table.txt"], "--plot"),
        (["summary", "--levers", "--plot", "levers.jpg"], "--plot"),
        (["status", "quick", "--selected-from", "/no/such/folder"], "--selected-from"),
    ],
)
def test_campaign_usage_errors_name_their_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    if torch.cuda.is_available() and flag == "--device":
        pytest.skip("this torch has a CUDA device: --device cuda is valid")
    records = [] if "--records" in argv else ["--records", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv, *records])
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any run


def test_bench_usage_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench"])
    usage = capsys.readouterr().err
    assert "{list,run,status,report,summary,select,ab}" in usage


def test_an_arm_with_knobs_must_have_kfac() -> None:
    with pytest.raises(ValueError, match="knobs are K-FAC's"):
        Arm("adamw", knobs=KFAC_KNOBS)
    with pytest.raises(ValueError, match="K-FAC does not run on soap"):
        Arm("soap", kfac=True)
    assert math.isfinite(get_case("text-lm").prior_lr("shampoo"))


def test_the_summary_lists_each_tasks_case_and_its_larger_batches() -> None:
    from kaisa_lab.bench.cases import summary_cases

    names = [c.name for c in summary_cases()]
    assert {"text-lm", "text-cnn", "text-lm-large", "text-lm-b128", "text-lm-b512"} <= set(names)
    assert "text-lm-levers" not in names and "quick" not in names


def test_the_summary_compares_each_kfac_arm_with_its_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kaisa_lab.bench.report import markdown_summary, verdict

    # every reading of the date a second later: a group's runs end at different times
    real_environment = campaign_module.environment
    ticks = iter(range(10**6))

    def environment(*args: Any) -> dict[str, Any]:
        return {**real_environment(*args), "date": f"2026-01-01T00:00:00+{next(ticks)}s"}

    monkeypatch.setattr(campaign_module, "environment", environment)
    campaign = Campaign(get_case("quick"), RecordStore(tmp_path))
    work(campaign, QUIET, wait_s=0)
    campaign.refresh()
    rows = {r.arm.name: r for r in heldout_rows(campaign)}
    # a held-out seed's arms stepped in one lockstep group, and their records say so
    for seed in campaign.protocol.heldout_seeds:
        groups = {r["group"] for row in rows.values() for r in row.records if r["seed"] == seed}
        assert len(groups) == 1 and groups.pop().startswith(f"heldout-s{seed}@")
    table = markdown_summary([campaign])
    (line,) = [row for row in table.splitlines() if row.startswith("| quick | 64 | sgd |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    ratio = paired_ratio(rows["sgd+kfac"], rows["sgd"])
    assert ratio is not None
    assert cells[4] == (f"{ratio:.2f}×" if math.isfinite(ratio) and ratio > 0 else "-")
    assert verdict(0.8) == "add K-FAC" and verdict(1.2) == "keep the optimizer alone"
    # the selection check: per selected arm, the setting fastest on its clock
    # beside the selected one; where neither sets an interval knob (whose steps
    # are weighed by their cost), never with fewer steps than the selected one
    from kaisa_lab.bench.report import markdown_selection

    check = markdown_selection(campaign).splitlines()[2:]
    assert len(check) == len([a for a in campaign.case.arms if campaign.state(a).selected])
    for line in check:
        cells = [c.strip() for c in line.strip("|").split("|")]
        chosen, clock = (float(c.split(",")[0].replace("-", "inf")) for c in (cells[2], cells[4]))
        assert cells[3] != "same" or chosen == clock
        if "_update_steps" not in cells[1] + cells[3]:
            assert chosen <= clock
    assert verdict(1.03) == "a tie" and verdict(math.nan) == "neither reaches the target"
    assert verdict(0.0) == "add K-FAC" and "misses" in verdict(math.inf)
    # a family still being measured is not summarised: one held-out run missing
    seed = campaign.protocol.heldout_seeds[-1]
    (missing,) = [r for r in rows["sgd"].records if r["seed"] == seed]
    (path,) = (tmp_path / "quick" / "sgd").glob(f"*-s{seed}.json")
    path.unlink()
    unfinished = Campaign(get_case("quick"), RecordStore(tmp_path))
    unfinished.refresh()
    assert missing["seed"] == seed and "| quick |" not in markdown_summary([unfinished])
    assert markdown_summary([unfinished]).startswith(
        "Still being measured (not every arm held out): `quick`;"
    )
    assert "Still being measured" not in markdown_summary([campaign])
    # ... but a lever arm with no record yet holds nothing back
    lever = Arm("sgd", kfac=True, lever=(("kfac.kl_clip", 0.1),), tag="clip0.1")
    case = dataclasses.replace(get_case("quick"), arms=(lever, *get_case("quick").arms))
    with_lever = Campaign(case, RecordStore(tmp_path))
    with_lever.refresh()
    assert "| quick |" not in markdown_summary([with_lever])  # sgd's record still missing
    (tmp_path / "quick" / "sgd" / path.name).write_text(json.dumps(missing))
    with_lever.refresh()
    assert markdown_summary([with_lever]) == table


def test_non_finite_outcomes_survive_the_record_file(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    record = {
        "kind": "train", "case": "c", "arm": "sgd", "key": "k", "seed": 0,
        "result": {"final_metric": math.nan, "steps": 3}, "curve": [{"metric": math.inf}],
        "config": {"name": "inf"},
    }  # fmt: skip
    path = store.write(record)
    assert '"nan"' in path.read_text()  # valid JSON: no bare NaN
    (back,) = store.read("c")
    assert math.isnan(back["result"]["final_metric"]) and back["curve"][0]["metric"] == math.inf
    assert back["config"]["name"] == "inf"  # only outcomes are numbers


def test_every_arm_spends_its_whole_budget() -> None:
    """A refined best's half steps are grid points already tried: the next follow-up is a
    quarter step, not an early end; an arm whose knobs are spent refines its lr."""
    p = Protocol()
    settings = grid(p, 0.01, (0.0, 0.25), "cosine")
    refined = Setting(0.01414, 0.0, "cosine")
    # the refined point is the best; 0.02 and 0.01 (its half steps) were tried
    assert followup(p, [*settings, refined], refined, ()) == Setting(0.01682, 0.0, "cosine")
    inner, tried = settings[2], list(settings)
    for _ in KFAC_KNOBS:
        knob = followup(p, tried, inner, KFAC_KNOBS)
        assert knob is not None and knob.kfac and knob.lr == inner.lr
        tried.append(knob)
    assert followup(p, tried, inner, KFAC_KNOBS) is None  # 12 of 12 spent
    longer = Protocol(budget=13)  # the knobs spent, the rest goes to the lr
    assert followup(longer, tried, inner, KFAC_KNOBS) == Setting(0.01414, 0.0, "cosine")


def test_every_arm_of_a_case_has_its_own_label_in_the_tables() -> None:
    from kaisa_lab.bench.report import arm_label

    for case in CASES.values():
        labels = [arm_label(arm) for arm in case.arms]
        assert len(set(labels)) == len(labels), (case.name, labels)


def test_the_levers_table_sets_each_lever_beside_kfac_at_the_defaults_on_its_base(
    tmp_path: Path,
) -> None:
    """What a lever bought: its held-out medians over K-FAC's at the library's
    defaults on the same base optimizer (the tuned K-FAC arm is no reference)."""
    from kaisa_lab.bench.report import markdown_levers

    quick = get_case("quick")
    assert markdown_levers(Campaign(quick, RecordStore(tmp_path / "none"))).startswith("_No lever")
    lever = Arm("sgd", kfac=True, lever=(("kfac.factor_decay", 0.9),), tag="decay0.9")
    case = dataclasses.replace(quick, arms=(*quick.arms, lever))
    campaign = Campaign(case, RecordStore(tmp_path))
    work(campaign, QUIET, wait_s=0)
    campaign.refresh()
    rows = {r.arm.name: r for r in heldout_rows(campaign)}
    ours, ref = rows["sgd+kfac-decay0.9"], rows["sgd+kfac"]
    table = markdown_levers(campaign)
    lines = [line for line in table.splitlines() if line.startswith("| sgd+kfac-decay0.9 |")]
    assert len(lines) == 1 and len(table.splitlines()) == 3  # one lever row
    cells = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert cells[1] == "sgd" and cells[2] == f"{ours.reached}/{ours.seeds}"
    # every figure a median over the held-out seeds of the two arms' ratio on each seed
    by_seed = [
        (mine["result"], theirs["result"])
        for mine in ours.records
        for theirs in ref.records
        if mine["seed"] == theirs["seed"]
    ]
    assert len(by_seed) == len(campaign.protocol.heldout_seeds)

    def cell(key: str, missed: float | None = math.inf) -> str:
        ratios = [quotient(*(r[key] if r["reached"] else missed for r in pair)) for pair in by_seed]
        ratios = [q for q in ratios if not math.isnan(q)]
        value = statistics.median(ratios) if ratios else math.nan
        return f"{value:.2f}" if math.isfinite(value) and value > 0 else "-"

    assert cells[3] == cell("steps_to_target")
    # the step's cost from the CPU clock, which every CPU run now records
    costs = [
        (a["step_times"]["cpu_median_ms"], b["step_times"]["cpu_median_ms"]) for a, b in by_seed
    ]
    assert cells[5] == f"{statistics.median(a / b for a, b in costs):.2f} (CPU)"
    ratio = paired_ratio(ours, ref)
    assert ratio is not None and cells[9] == lever_verdict(ratio)
    assert cells[6] == cell("time_to_target_s") and cells[8] == cell("cpu_time_to_target_s")
    # read between evaluations: the same pairing of each run's crossing
    pairs = [(m, t) for m in ours.records for t in ref.records if m["seed"] == t["seed"]]
    for index, read in ((4, steps_between), (7, time_between)):
        ratios = [quotient(read(a), read(b)) for a, b in pairs]
        ratios = [q for q in ratios if not math.isnan(q)]
        value = statistics.median(ratios) if ratios else math.nan
        assert cells[index] == (f"{value:.2f}" if math.isfinite(value) and value > 0 else "-")

    # across families: the same paired ratio in the case's column, "-" in a case
    # that runs the lever but has no record of it, and the families measured
    from kaisa_lab.bench.report import lever_word, markdown_levers_across

    unrun = Campaign(dataclasses.replace(case, name="quick-unrun"), RecordStore(tmp_path))
    across = markdown_levers_across([campaign, unrun])
    head, _, row = across.splitlines()
    assert head == "| lever | `quick` | `quick-unrun` | the families measured |"
    word = lever_word(ratio)
    shown = f"{ratio:.2f}× {word}" if math.isfinite(ratio) and ratio > 0 else None
    assert row.startswith("| sgd+kfac-decay0.9 | ")
    assert row.endswith(f" | - | {word} (1 family) |")
    if shown is not None:
        assert f"| {shown} |" in row
    assert lever_word(0.8) == "win" and lever_word(1.2) == "loss" and lever_word(1.01) == "tie"
    assert lever_word(0.0) == "win" and lever_word(math.inf) == "loss"


def test_a_levers_verdict_reads_the_time_ratio_with_a_tie_band() -> None:
    from kaisa_lab.bench.report import lever_verdict

    assert lever_verdict(0.8) == "wins (20% less time)"
    assert lever_verdict(1.25) == "loses (25% more time)"
    assert lever_verdict(1.03) == lever_verdict(0.97) == "a tie"
    assert lever_verdict(math.inf) == "loses (misses the target)"
    assert lever_verdict(math.nan) == "neither reaches the target"
    assert lever_verdict(0.0) == "wins (the defaults miss the target)"


def _row(name: str, times: list[float | None], cpu_ms: list[float]) -> Any:
    """An arm's held-out row from per-seed times to target (None: a miss)."""
    from kaisa_lab.bench.rows import ArmRow

    records = tuple(
        {
            "seed": seed,
            "result": {
                "reached": t is not None,
                "time_to_target_s": t,
                "steps_to_target": None if t is None else 10 * t,
                "step_times": {"median_ms": 1.0, "cpu_median_ms": ms},
            },
        }
        for seed, (t, ms) in enumerate(zip(times, cpu_ms, strict=True))
    )
    return ArmRow(Arm(name), "s", len(times), 0, None, None, 0.0, None, records)


def test_ratios_pair_the_arms_of_each_seed() -> None:
    """Each seed's arms share a lockstep group and its load; seeds' groups do not. A
    ratio of medians mixes one arm's busy seed with the other's quiet one; the
    paired ratio (the median of the per-seed ratios) does not."""
    # every seed: 0.8× the reference, each seed under its own load
    ours = _row("sgd", [8.0, 16.0, 32.0, 2.4], [1.0] * 4)
    ref = _row("adamw", [10.0, 20.0, 40.0, 3.0], [2.0] * 4)
    assert paired_ratio(ours, ref) == pytest.approx(0.8)
    # seeds under loads 1, 3 and 1.5: ours takes 100, 100 and 130 steps, the reference 125,
    # 125 and 110: 0.8× on two seeds of three, yet the ratio of the medians reads 1.18
    ours = _row("sgd", [100.0, 300.0, 195.0], [1.0] * 3)
    ref = _row("adamw", [125.0, 375.0, 165.0], [2.0] * 3)
    assert statistics.median([100.0, 300.0, 195.0]) / statistics.median([125, 375, 165]) > 1.1
    assert paired_ratio(ours, ref) == pytest.approx(0.8)
    # misses: ours alone (infinity), the reference alone (0), both (no ratio)
    ours = _row("sgd", [None, 1.0, None, 2.4], [1.0] * 4)
    ref = _row("adamw", [10.0, None, None, 3.0], [2.0] * 4)
    assert paired_ratio(ours, ref) == pytest.approx(0.8)  # median of inf, 0, 0.8
    assert math.isnan(cast(float, paired_ratio(_row("a", [None], [1.0]), _row("b", [None], [1.0]))))
    # the other clocks pair the same way; a value not recorded leaves no figure
    from kaisa_lab.bench.rows import cpu_step_ms, cpu_time_to_target

    assert paired_ratio(ours, ref, cpu_step_ms) == pytest.approx(0.5)
    assert paired_ratio(ours, ref, cpu_time_to_target) is None  # these records carry no CPU time


def _grouped(row: Any, groups: list[str]) -> Any:
    """``row`` with each seed's record naming its lockstep group (and its runs)."""
    records = tuple(
        {**r, "key": f"{row.arm.name}-{r['seed']}", "group": g, "lockstep": [f"k{g}"]}
        for r, g in zip(row.records, groups, strict=True)
    )
    return dataclasses.replace(row, records=records)


def test_selection_reads_steps_not_another_groups_clock() -> None:
    """A follow-up timed under a lighter load than the grid's group of ten is
    faster on its clock with more steps: the rule takes the fewer steps, the
    check (:func:`fastest`) names the clock's pick; a setting that changes a
    step's work is weighed by its measured step cost."""
    from kaisa_lab.bench.protocol import fastest, work_base

    grid, later = Setting(0.08, 0.0, "cosine"), Setting(0.16, 0.0, "cosine")
    results = {
        grid: [Outcome(146.0, 50, 2.4), Outcome(150.0, 50, 2.4)],  # a group of ten
        later: [Outcome(143.0, 60, 2.4), Outcome(140.0, 60, 2.4)],  # a group of one
    }
    assert best(results, higher_is_better=False) == grid
    assert fastest(results) == later
    # a setting not run on every seed competes in neither
    partial = {**results, Setting(0.04, 0.0, "cosine"): [Outcome(90.0, 30, 2.4)]}
    assert best(partial, higher_is_better=False) == grid and fastest(partial) == later
    assert best({}, higher_is_better=False) is None and fastest({}) is None
    # an interval knob: 45 steps at 1.2x the step cost (54) lose to 50 at 1.0x,
    # at 1.1x (49.5) they win; without a measured cost the rule refuses to rank it
    knob = Setting(0.08, 0.0, "cosine", (("damping", 0.1), ("inv_update_steps", 10)))
    assert work_base(knob) == Setting(0.08, 0.0, "cosine", (("damping", 0.1),))
    assert work_base(grid) is None
    assert work_base(Setting(0.08, 0.0, "cosine", (("damping", 0.1),))) is None
    priced = {**results, knob: [Outcome(200.0, 45, 2.4), Outcome(200.0, 45, 2.4)]}
    assert best(priced, higher_is_better=False, costs={knob: 1.2}) == grid
    assert best(priced, higher_is_better=False, costs={knob: 1.1}) == knob
    with pytest.raises(ValueError, match=r"costs: no step cost for lr 0\.08"):
        best(priced, higher_is_better=False)


def test_a_cost_pair_compares_its_runs_over_the_same_steps() -> None:
    """The two runs stop at their own targets: the ratio is of their clocks at
    the last reading both made, not of whole runs of different lengths."""
    from kaisa_lab.bench.campaign import pair_ratio

    def record(points: list[tuple[int, float]]) -> dict[str, Any]:
        step, time_s = points[-1]
        curve = [{"step": n, "time_s": t} for n, t in points]
        return {"curve": curve, "result": {"steps": step, "train_time_s": time_s}}

    knob = record([(0, 0.0), (20, 2.0), (40, 4.4)])
    base = record([(0, 0.0), (20, 1.0), (40, 2.0), (60, 3.5)])
    assert pair_ratio(knob, base) == pytest.approx(2.2)  # at step 40, not 0.11 / 0.0583
    for r in (knob, base):
        r["curve"] = []  # no shared reading: amortised times a step
    assert pair_ratio(knob, base) == pytest.approx((4.4 / 40) / (3.5 / 60))


def test_a_setting_that_changes_a_steps_work_is_priced_by_a_cost_pair(tmp_path: Path) -> None:
    """The campaign holds a knob variant's arm at the ``cost`` stage until its
    cost pair (it and its base, side by side, records apart from the tuning's)
    is recorded on every selection seed, then selects with the pair's ratio."""
    case = get_case("quick")
    arm = next(a for a in case.arms if a.knobs)
    store = RecordStore(tmp_path)
    campaign = Campaign(case, store)

    def put(run: Any, steps: int, train_time: float) -> None:
        result = {"steps_to_target": steps, "time_to_target_s": train_time, "steps": steps}
        store.write(
            {
                "kind": "train",
                "case": case.name,
                "arm": run.arm.kind,
                "role": run.role,
                "seed": run.seed,
                "key": run.key,
                "result": {
                    **result,
                    "train_time_s": train_time,
                    "final_metric": 0.9,
                    "reached": True,
                },
            }
        )

    settings = case.grid(arm)
    inner = settings[1]  # the middle lr, no warm-up: the best, not at an edge
    for s in settings:
        put(campaign.run(arm, s, 0, "grid"), 20 if s == inner else 40, 1.0)
    campaign.refresh()
    state = campaign.state(arm)
    assert state.stage == "followup" and state.pending is not None
    knob = state.pending
    assert work_base(knob) == inner
    put(campaign.run(arm, knob, 0, "followup"), 18, 0.5)  # fewer steps, on a lighter clock
    campaign.refresh()
    state = campaign.state(arm)
    assert (state.stage, state.pending, state.selected) == ("cost", knob, None)
    assert any(f"; pricing {knob.describe()}" in line for line in campaign.status())
    (unit,) = [u for u in campaign.units() if u.stage == "cost"]
    pair = campaign.cost_pair(arm, knob, 0)
    assert unit.runs == pair and [r.setting for r in pair] == [knob, inner]
    tuning_keys = {campaign.run(arm, s, 0, "").key for s in (knob, inner)}
    assert {r.role for r in pair} == {"cost"} and not {r.key for r in pair} & tuning_keys
    assert {r.spec.cost_pair for r in pair} == {campaign.run(arm, knob, 0, "").key}
    # a worker trains the pair like any unit, and the records are found as the pair's
    assert work(campaign, QUIET, stages=("cost",), wait_s=0) == 1
    campaign.refresh()
    assert all(campaign.record(run) is not None for run in pair)
    assert campaign.step_cost(arm, knob) is not None
    # side by side its step costs 2x its base's: 18 steps weigh 36 > 20
    put(pair[0], 30, 3.0)
    put(pair[1], 20, 1.0)
    campaign.refresh()
    assert campaign.step_cost(arm, knob) == pytest.approx(2.0)
    state = campaign.state(arm)
    assert state.stage == "heldout" and state.selected == inner
    assert "| 2.00× |" in markdown_tuning(campaign)
    put(pair[0], 30, 1.5)  # at 1.0x its 18 steps win
    campaign.refresh()
    assert campaign.state(arm).selected == knob


def test_wall_clock_ratios_pair_only_runs_that_stepped_side_by_side() -> None:
    """An arm held out after the others ran its seeds in groups of its own,
    under another load: its wall-clock ratios to them are not paired (a cell
    reads ``apart``), its steps and CPU times still pair by seed. Records
    from before groups listed their runs pair by seed as they always did."""
    from kaisa_lab.bench.report import _paired_cell
    from kaisa_lab.bench.rows import cpu_step_ms, steps_to_target, trained_apart

    ours = _row("lever", [8.0, 16.0, 32.0], [1.0] * 3)
    ref = _row("defaults", [10.0, 20.0, 40.0], [2.0] * 3)
    together = ["heldout-s0@t0", "heldout-s1@t1", "heldout-s2@t2"]
    later = ["heldout-s0@t9", "heldout-s1@t9", "heldout-s2@t9"]
    # side by side on every seed: paired as before
    assert paired_ratio(_grouped(ours, together), _grouped(ref, together)) == pytest.approx(0.8)
    # apart on every seed: no wall-clock ratio, the cell says why; steps and CPU pair
    mine, theirs = _grouped(ours, later), _grouped(ref, together)
    assert trained_apart(mine, theirs) and not trained_apart(_grouped(ours, together), theirs)
    assert paired_ratio(mine, theirs) is None
    assert _paired_cell(mine, theirs) == "apart"
    assert paired_ratio(mine, theirs, steps_to_target) == pytest.approx(0.8)
    assert _paired_cell(mine, theirs, cpu_step_ms) == "0.50"
    # apart on one seed of three: that seed's wall clock is left out
    skewed = _row("lever", [8.0, 30.0, 1.0], [1.0] * 3)  # 0.8, 1.5 and 0.025 the reference
    mixed = _grouped(skewed, [*together[:2], later[2]])
    assert paired_ratio(mixed, theirs) == pytest.approx((0.8 + 1.5) / 2)
    assert not trained_apart(mixed, theirs)
    # two records without the list (from before it was kept) pair by seed; one
    # from before and one since never shared a group
    assert paired_ratio(ours, ref) == pytest.approx(0.8)
    assert paired_ratio(ours, theirs) is None and trained_apart(ours, theirs)
