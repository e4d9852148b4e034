"""A lockstep group stopped part-way goes on from its snapshots bit for bit."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kaisa_lab.bench.cases import get_case
from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.snapshot import Snapshots
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.cli.train import train_lockstep
from kaisa_lab.optim.build import check_available
from kaisa_lab.tasks.registry import get_task

CPU = DistContext(device=torch.device("cpu"))
QUIET = Progress(enabled=False, bars=False)


class _InterruptedError(Exception):
    pass


class _StopAfter(Progress):
    """Progress that stops the group (as a killed worker would) after ``steps`` rounds."""

    def __init__(self, steps: int) -> None:
        super().__init__(enabled=False, bars=False)
        self.left = steps

    def step(self, loss: torch.Tensor) -> None:
        self.left -= 1
        if self.left < 0:
            raise _InterruptedError


def _spec(optimizer: str, kfac: bool, **changes: Any) -> RunSpec:
    case = get_case("quick")
    base = case.spec(case.arms[1], case.grid(case.arms[1])[1], 0)
    kwargs = {"loss_average": "batch", "factor_update_steps": 3, "inv_update_steps": 9}
    if optimizer == "muon":
        changes = {"adamw_lr": 0.003, "adamw_weight_decay": 0.0, **changes}
    return dataclasses.replace(
        base,
        name=f"{optimizer}{'+kfac' if kfac else ''}",
        optimizer=optimizer,
        kfac=kfac,
        lr=0.003 if optimizer in ("adamw", "soap", "shampoo", "lamb") else 0.05,
        epochs=2,
        evals_per_epoch=4,
        stop_at_target=False,
        schedule="cosine",
        warmup_epochs=0.25,
        kfac_kwargs=kwargs if kfac else {},
        **changes,
    )


def _curve(result: Any) -> list[tuple[int, float, float]]:
    return [(r.step, r.train_loss, r.metric) for r in result.curve]


def _resume_matches(specs: list[RunSpec], tmp_path: Path, stop_at: int) -> None:
    task = get_task("digits-mlp")
    data = task.load()
    whole = train_lockstep(specs, task, data, CPU, QUIET)
    every_round = Snapshots(tmp_path, every_s=0.0)
    with pytest.raises(_InterruptedError):
        train_lockstep(specs, task, data, CPU, _StopAfter(stop_at), snapshots=every_round)
    assert len(list(tmp_path.glob("*.pt"))) == len(specs)
    resumed = train_lockstep(specs, task, data, CPU, QUIET, snapshots=Snapshots(tmp_path, 1e9))
    for a, b in zip(whole, resumed, strict=True):
        assert len(a.curve) == 2 * 4
        assert _curve(a) == _curve(b)
        assert (a.stopped, a.initial_weights, a.data_order) == (
            b.stopped,
            b.initial_weights,
            b.data_order,
        )
        assert a.resumed_at == [] and b.resumed_at == [stop_at]
        assert a.step_times is not None and b.step_times is not None
        assert a.step_times.count == b.step_times.count  # the steps before the stop kept
        # and their CPU times: every step has one, so the resumed run has a CPU median,
        # and every reading its cumulative CPU time (growing, at most the wall clock's
        # plus the intra-op threads'; one thread here)
        assert a.step_times.cpu_median_ms is not None and b.step_times.cpu_median_ms is not None
        for run in (a, b):
            cpu = [r.cpu_time_s for r in run.curve]
            assert all(c is not None and c > 0 for c in cpu) and cpu == sorted(cpu)
    assert list(tmp_path.glob("*.pt")) == []  # deleted as each run ended


@pytest.mark.parametrize(
    ("optimizer", "kfac"),
    [("sgd", False), ("sgd", True), ("adamw", True), ("muon", False), ("muon", True)],
)
def test_a_group_stopped_mid_interval_resumes_bit_for_bit(
    optimizer: str, kfac: bool, tmp_path: Path
) -> None:
    """Stopped after step 17 (mid-epoch, between evaluations, between K-FAC's
    factor and inverse updates, in the warm-up's wake): the resumed runs' curves
    equal the uninterrupted runs' exactly."""
    _resume_matches([_spec(optimizer, kfac)], tmp_path, stop_at=17)


def test_a_mixed_group_with_levers_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Several runs in one group, one drawing labels from its own generator
    (the Monte Carlo Fisher), one resumed twice over."""
    specs = [_spec("sgd", True, fisher="mc"), _spec("adamw", False), _spec("sgd", True)]
    _resume_matches(specs, tmp_path, stop_at=30)


@pytest.mark.parametrize("optimizer", ["lamb", "soap", "shampoo"])
def test_the_baselines_resume_bit_for_bit(optimizer: str, tmp_path: Path) -> None:
    try:
        check_available(optimizer)
    except ImportError as exc:
        pytest.skip(f"{optimizer}: {exc}")
    _resume_matches([_spec(optimizer, False, compile_baseline=False)], tmp_path, stop_at=11)


def test_a_snapshot_from_before_the_cpu_clock_resumes_without_cpu_times(tmp_path: Path) -> None:
    """A snapshot written by a runner that kept no CPU clock (an in-flight
    group of a campaign pinned to an older commit) still resumes to the same
    curve; the run's CPU median is then unknown (None), not a median of the
    steps after the restore alone."""
    specs = [_spec("sgd", True)]
    task = get_task("digits-mlp")
    data = task.load()
    whole = train_lockstep(specs, task, data, CPU, QUIET)
    with pytest.raises(_InterruptedError):
        train_lockstep(specs, task, data, CPU, _StopAfter(9), snapshots=Snapshots(tmp_path, 0.0))
    (path,) = tmp_path.glob("*.pt")
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert len(saved["state"]["cpu_seconds"]) == 9 and saved["state"]["cpu_clock_s"] > 0
    del saved["state"]["cpu_seconds"], saved["state"]["cpu_clock_s"]
    torch.save(saved, path)
    (resumed,) = train_lockstep(specs, task, data, CPU, QUIET, snapshots=Snapshots(tmp_path, 1e9))
    assert _curve(resumed) == _curve(whole[0]) and resumed.resumed_at == [9]
    assert resumed.step_times is not None and resumed.step_times.median_ms > 0
    assert resumed.step_times.cpu_median_ms is None
    # the readings after the restore have no CPU clock to read (those before keep theirs)
    assert [r.cpu_time_s is None for r in resumed.curve] == [r.step > 9 for r in resumed.curve]
    assert resumed.cpu_time_to_target_s is None
    assert whole[0].step_times is not None and whole[0].step_times.cpu_median_ms is not None


def test_a_snapshot_of_another_config_is_not_restored(tmp_path: Path) -> None:
    snapshots = Snapshots(tmp_path)
    spec = _spec("sgd", False)
    snapshots.save(spec, {"anything": 1})
    assert snapshots.load(spec) == {"anything": 1}
    other = dataclasses.replace(spec, lr=spec.lr * 2)
    assert snapshots.path(other) != snapshots.path(spec) and snapshots.load(other) is None
    snapshots.path(spec).rename(snapshots.path(other))  # a digest collision, in effect
    assert snapshots.load(other) is None
    with pytest.raises(ValueError, match="every_s"):
        Snapshots(tmp_path, every_s=-1.0)


def _pending_line(campaign: Any) -> str:
    """The status line that says what is pending and what is in flight."""
    return next(line for line in campaign.status() if line.startswith("pending now: "))


def test_a_campaign_unit_stopped_part_way_goes_on_from_its_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed in the middle of a unit: the next worker resumes its runs
    (the record says where), and their records equal an uninterrupted worker's.
    The resumed group is the group that started: its runs record its label and
    the runs it started with, as they would have uninterrupted."""
    from kaisa_lab.bench import campaign as campaign_module
    from kaisa_lab.bench.campaign import Campaign, work
    from kaisa_lab.bench.records import RecordStore

    # every reading of the date a second later: a group started again is told apart
    real_environment = campaign_module.environment
    ticks = iter(range(10**6))

    def environment(*args: Any) -> dict[str, Any]:
        return {**real_environment(*args), "date": f"2026-01-01T00:00:00+{next(ticks)}s"}

    monkeypatch.setattr(campaign_module, "environment", environment)
    whole = RecordStore(tmp_path / "whole")
    work(Campaign(get_case("quick"), whole), QUIET, max_units=1, wait_s=0)
    ran = list(whole.read("quick"))
    assert len({r["group"] for r in ran}) == 1
    assert all(sorted(r["lockstep"]) == sorted(x["key"] for x in ran) for r in ran)
    stopped = RecordStore(tmp_path / "stopped")
    with pytest.raises(_InterruptedError):
        work(
            Campaign(get_case("quick"), stopped),
            _StopAfter(9),
            max_units=1,
            wait_s=0,
            snapshot_every_s=0.0,
        )
    assert list(stopped.read("quick")) == []
    saved = list((tmp_path / "stopped" / "quick" / ".snapshots").glob("*.pt"))
    status = _pending_line(Campaign(get_case("quick"), stopped))
    assert saved and status.endswith(f"{len(saved)} run(s) in flight saved to resume")
    (group_file,) = (tmp_path / "stopped" / "quick" / ".snapshots").glob("*.group")
    started = json.loads(group_file.read_text())
    work(Campaign(get_case("quick"), stopped), QUIET, max_units=1, wait_s=0, snapshot_every_s=1e9)
    resumed = list(stopped.read("quick"))
    assert {r["group"] for r in resumed} == {started["label"]}
    assert all(r["lockstep"] == started["lockstep"] for r in resumed)
    assert not group_file.exists()  # the group ended: a unit of its name later is a new one
    first = {(r["key"], r["seed"]): r for r in whole.read("quick")}
    again = {(r["key"], r["seed"]): r for r in stopped.read("quick")}
    assert first.keys() == again.keys() and len(first) > 1
    for ident, record in first.items():
        other = again[ident]
        assert "resumed_at" not in record["result"] and other["result"]["resumed_at"] == [9]
        curve = [(p["step"], p["train_loss"], p["metric"]) for p in record["curve"]]
        assert curve == [(p["step"], p["train_loss"], p["metric"]) for p in other["curve"]]
    assert not list((tmp_path / "stopped" / "quick" / ".snapshots").glob("*.pt"))
    # a worker stopped after writing a record, before deleting its snapshot: the
    # next unit taken clears it (its run is done; it would never be read)
    spare = next(iter(stopped.read("quick")))
    orphan = Snapshots(tmp_path / "stopped" / "quick" / ".snapshots").path(spare["config"])
    orphan.write_bytes(b"left behind")
    work(Campaign(get_case("quick"), stopped), QUIET, max_units=1, wait_s=0, snapshot_every_s=1e9)
    assert not orphan.exists()
    after = _pending_line(Campaign(get_case("quick"), stopped))
    assert after.startswith("pending now: ") and after.endswith(
        " 0 run(s) in flight saved to resume"
    )


@pytest.mark.parametrize("damage", ["truncated", "another_state"])
def test_a_snapshot_that_cannot_be_restored_starts_its_run_afresh(
    damage: str, tmp_path: Path
) -> None:
    """A bad file must not stop a campaign: the run starts again from step 0
    and ends as the uninterrupted run does."""
    task = get_task("digits-mlp")
    data = task.load()
    spec = _spec("sgd", True)
    (whole,) = train_lockstep([spec], task, data, CPU, QUIET)
    snapshots = Snapshots(tmp_path, every_s=1e9)
    if damage == "truncated":
        snapshots.path(spec).parent.mkdir(parents=True, exist_ok=True)
        snapshots.path(spec).write_bytes(b"PK\x03\x04 not a whole file")
    else:
        snapshots.save(spec, {"trainer": {"model": {}}})  # keys the lane does not have
    log = io.StringIO()
    (again,) = train_lockstep(
        [spec], task, data, CPU, Progress(enabled=True, bars=False, stream=log), snapshots=snapshots
    )
    assert "could not be restored" in log.getvalue()
    assert _curve(again) == _curve(whole) and again.resumed_at == []
    assert not snapshots.path(spec).exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_group_on_cuda_resumes_bit_for_bit(tmp_path: Path) -> None:
    """On a GPU (tools/device_check.sh runs it): the run's loss sum and CUDA
    generator states go back to the device."""
    task = get_task("digits-mlp")
    data = task.load()
    gpu = DistContext(device=torch.device("cuda"))
    specs = [_spec("sgd", True), _spec("adamw", False)]
    whole = train_lockstep(specs, task, data, gpu, QUIET)
    with pytest.raises(_InterruptedError):
        train_lockstep(specs, task, data, gpu, _StopAfter(17), snapshots=Snapshots(tmp_path, 0.0))
    resumed = train_lockstep(specs, task, data, gpu, QUIET, snapshots=Snapshots(tmp_path, 1e9))
    for a, b in zip(whole, resumed, strict=True):
        assert _curve(a) == _curve(b) and b.resumed_at == [17]
