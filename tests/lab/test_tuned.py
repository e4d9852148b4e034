"""A task's lr is "tuned" only where the benchmark suite selected it from runs.

``kaisa_lab/tasks/tuned.json`` is written by ``kaisa bench select CASE --write``;
these tests re-derive every selection in it from the committed records, so a
number edited by hand, or records changed after the selection, fail here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kaisa_lab.bench.campaign import Campaign, selections, work
from kaisa_lab.bench.cases import get_case
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.cli.progress import Progress
from kaisa_lab.optim import OPTIMIZERS
from kaisa_lab.tasks import tuned
from kaisa_lab.tasks.registry import TASKS, get_task

# the records were made with the library's own defaults: their keys hold them

ROOT = Path(__file__).resolve().parents[2]
RECORDS = RecordStore(ROOT / "benchmarks" / "records")


def test_every_selection_is_what_the_committed_records_select() -> None:
    for task, arms in tuned.load().items():
        derived = selections(Campaign(get_case(task), RECORDS))
        for arm, chosen in arms.items():
            assert arm in derived, f"{task}/{arm}: no record selects it"
            assert derived[arm] == chosen, f"{task}/{arm}: the records select {derived[arm]}"


@pytest.mark.parametrize("name", list(TASKS))
def test_lr_tuned_exactly_where_a_selection_exists(name: str) -> None:
    task = get_task(name)
    chosen = tuned.load().get(name, {})
    for optimizer in OPTIMIZERS:
        for kfac in (False, True):
            arm = f"{optimizer}+kfac" if kfac else optimizer
            assert task.lr_tuned(optimizer, kfac) == (arm in chosen)
            if arm in chosen:
                assert task.arm(kfac, optimizer) == (
                    chosen[arm].lr,
                    chosen[arm].schedule,
                    chosen[arm].warmup_epochs,
                )


def test_select_writes_what_the_protocol_chose_and_the_task_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    campaign = Campaign(get_case("quick"), RecordStore(tmp_path / "records"))
    work(campaign, Progress(enabled=False, bars=False), wait_s=0)
    campaign.refresh()
    chosen = selections(campaign)
    assert set(chosen) == {"sgd", "sgd+kfac", "sgd+kfac tuned"}
    for arm in campaign.case.arms:
        s = campaign.state(arm).selected
        assert s is not None and chosen[arm.name].lr == s.lr
        assert chosen[arm.name].runs == campaign.protocol.budget * 1  # one selection seed
    path = tmp_path / "tuned.json"
    tuned.write({"digits-mlp": chosen}, path=path)
    read = tuned.load.__wrapped__  # the uncached reader, before the patch below
    monkeypatch.setattr(tuned, "load", lambda path=path: read(path))
    task = get_task("digits-mlp")
    assert task.lr_tuned("sgd") and task.lr_tuned("sgd", kfac=True)
    assert not task.lr_tuned("adamw")
    assert task.arm(False, "sgd")[0] == chosen["sgd"].lr
    assert task.arm(False, "adamw")[0] == task.defaults.lr["adamw"]  # the prior


def test_a_selection_is_plain_data() -> None:
    s = tuned.Selection(0.1, 0.25, "cosine", {"damping": 0.1}, "text-lm", 12, 36)
    assert dataclasses.asdict(s)["kfac"] == {"damping": 0.1}
