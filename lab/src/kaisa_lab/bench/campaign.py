"""Carry out the tuning protocol of a case: what to run next, run it, record it, resume.

The state of a campaign is its records and nothing else: every step asks the
protocol (:mod:`kaisa_lab.bench.protocol`) what the records so far call for
next, so a campaign stopped at any point goes on where it stopped, and runs
whose record exists are never run again. The work comes in **units**, each a
lockstep group (:func:`kaisa_lab.cli.train.train_lockstep`: each run one step in
turn, each on its own clock):

- ``grid``: the grid of one kind of run on one selection seed;
- ``followup``: every arm's next follow-up on one selection seed (a grid's
  or a follow-up's later selection seeds wait for its deciding seeds,
  :attr:`~kaisa_lab.bench.protocol.Protocol.deciding_seeds`, and run only the
  settings those left a chance of being selected,
  :func:`~kaisa_lab.bench.protocol.settled`);
- ``cost``: on one selection seed, every arm's cost pair: a tried setting
  that changes a step's work (a K-FAC interval) and the same setting without
  that knob, side by side, so their clocks over the same steps compare
  under one load (what the selection weighs the setting's steps by);
- ``heldout``: every arm's selected setting on one held-out seed, all arms in
  one group, so the load of the machine falls on the arms of a reported
  comparison alike. Held-out units start only when every arm is selected.

Several workers may share a record folder: a unit is claimed by a lock file
(its owner's process id; a dead owner's lock is taken over), and each run's
record is written the moment the run ends.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kaisa_lab.bench.cases import Arm, TrainCase
from kaisa_lab.bench.protocol import Outcome, Setting, best, followup, settled, work_base
from kaisa_lab.bench.records import RecordStore, config_key, environment, load_average, train_record
from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.progress import Progress
from kaisa_lab.cli.snapshot import Snapshots
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.cli.train import RunResult, train_lockstep, warm_up
from kaisa_lab.tasks.registry import get_task
from kaisa_lab.tasks.tuned import Selection

__all__ = ["ArmState", "Campaign", "Run", "Unit", "duration", "pair_ratio", "selections", "work"]


@dataclass(frozen=True)
class Run:
    """One run a unit trains: an arm's setting on a seed."""

    arm: Arm
    setting: Setting
    seed: int
    role: str
    spec: RunSpec

    @property
    def key(self) -> str:
        return config_key(self.spec.to_dict())

    @property
    def label(self) -> str:
        return f"{self.arm.kind} {self.setting.describe()} seed {self.seed}"


@dataclass(frozen=True)
class Unit:
    """A lockstep group of runs: one stage on one seed."""

    stage: str
    seed: int
    runs: tuple[Run, ...]

    @property
    def name(self) -> str:
        return f"{self.stage}-s{self.seed}"


@dataclass(frozen=True)
class ArmState:
    """Where an arm stands: its stage, the settings tried, and (once done) its choice."""

    arm: Arm
    stage: str  # "grid", "followup", "cost", "heldout" or "done"
    tried: tuple[Setting, ...]
    pending: Setting | None  # the follow-up being run, or the setting a cost pair prices
    selected: Setting | None
    #: in the grid and follow-up stages, the selection seeds each setting
    #: needs now (the settings that need none left out)
    needed: tuple[tuple[Setting, tuple[int, ...]], ...] = ()


class Campaign:
    """The protocol of ``case`` over the records in ``store``."""

    def __init__(self, case: TrainCase, store: RecordStore) -> None:
        self.case = case
        self.store = store
        self.protocol = case.protocol
        self._index: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the records again (another worker may have written some)."""
        self._index = {(r["arm"], r["key"], r["seed"]): r for r in self.store.read(self.case.name)}

    def run(self, arm: Arm, setting: Setting, seed: int, role: str) -> Run:
        return Run(arm, setting, seed, role, self.case.spec(arm, setting, seed))

    def record(self, run: Run) -> dict[str, Any] | None:
        return self._index.get((run.arm.kind, run.key, run.seed))

    def records(self, arm: Arm, setting: Setting, seeds: Sequence[int]) -> list[dict[str, Any]]:
        found = (self.record(self.run(arm, setting, seed, "")) for seed in seeds)
        return [r for r in found if r is not None]

    def outcomes(self, arm: Arm, setting: Setting, seeds: Sequence[int]) -> list[Outcome]:
        return [
            Outcome(
                r["result"]["time_to_target_s"],
                r["result"]["steps_to_target"],
                r["result"]["final_metric"],
            )
            for r in self.records(arm, setting, seeds)
        ]

    def _missing(self, arm: Arm, setting: Setting, seeds: Sequence[int]) -> list[int]:
        return [s for s in seeds if self.record(self.run(arm, setting, s, "")) is None]

    def cost_pair(self, arm: Arm, setting: Setting, seed: int) -> tuple[Run, Run]:
        """The two runs that price ``setting`` (which sets a work knob) on
        ``seed``: it, and it without its work knobs, each marked as the pair's."""
        base = work_base(setting)
        if base is None:
            raise ValueError(f"{setting.describe()} changes no step's work: nothing to price")
        pair = self.run(arm, setting, seed, "").key

        def run(s: Setting) -> Run:
            return Run(arm, s, seed, "cost", replace(self.case.spec(arm, s, seed), cost_pair=pair))

        return run(setting), run(base)

    def step_cost(self, arm: Arm, setting: Setting) -> float | None:
        """``setting``'s step cost against the same setting without its work
        knobs: the median over the selection seeds of the cost pair's ratio
        (:func:`pair_ratio`, the two runs of a pair in one lockstep group);
        None until every seed's pair is recorded."""
        ratios = []
        for seed in self.protocol.selection_seeds:
            knob, base = (self.record(run) for run in self.cost_pair(arm, setting, seed))
            if knob is None or base is None:
                return None
            ratios.append(pair_ratio(knob, base))
        return statistics.median(ratios)

    def needed(self, arm: Arm, tried: Sequence[Setting]) -> dict[Setting, tuple[int, ...]]:
        """The selection seeds each of ``tried`` needs now: its deciding seeds
        it lacks; once every one has those, the later seeds it lacks, unless
        the outcomes so far have :func:`settled` it (its other runs could not
        change the choice). Settings that need nothing are left out."""
        deciding = self.protocol.deciding_seeds
        missing = {s: tuple(self._missing(arm, s, deciding)) for s in tried}
        if any(missing.values()):
            return {s: m for s, m in missing.items() if m}
        seeds = self.protocol.selection_seeds
        later = [seed for seed in seeds if seed not in deciding]
        out = self.settled(arm, tried)
        found = {s: tuple(self._missing(arm, s, later)) for s in tried if s not in out}
        return {s: m for s, m in found.items() if m}

    def state(self, arm: Arm) -> ArmState:
        """Replay the protocol for ``arm`` over the records: where it stands now."""
        seeds = self.protocol.selection_seeds
        tried = list(self.case.grid(arm))
        needed = self.needed(arm, tried)
        if needed:
            return ArmState(arm, "grid", tuple(tried), None, None, tuple(needed.items()))
        higher = get_task(self.case.task).metric.higher_is_better
        while True:
            costs: dict[Setting, float] = {}
            for s in tried:
                if work_base(s) is None:
                    continue
                cost = self.step_cost(arm, s)
                if cost is None:
                    return ArmState(arm, "cost", tuple(tried), s, None)
                costs[s] = cost
            chosen = best({s: self.outcomes(arm, s, seeds) for s in tried}, higher, costs)
            assert chosen is not None  # every tried setting has the outcomes it needs
            nxt = followup(self.protocol, tried, chosen, arm.knobs)
            if nxt is None:
                break
            needed = self.needed(arm, [*tried, nxt])
            if needed:
                return ArmState(arm, "followup", tuple(tried), nxt, None, tuple(needed.items()))
            tried.append(nxt)
        stage = "heldout" if self._missing(arm, chosen, self.protocol.heldout_seeds) else "done"
        return ArmState(arm, stage, tuple(tried), None, chosen)

    def units(self) -> list[Unit]:
        """Every unit the records call for now, in the order a worker should take them."""
        states = [self.state(arm) for arm in self.case.arms]
        units: list[Unit] = []
        seeds = self.protocol.selection_seeds
        kinds = dict.fromkeys(st.arm.kind for st in states if st.stage == "grid")
        for seed in seeds:
            for kind in kinds:
                runs = [
                    self.run(st.arm, s, seed, "grid")
                    for st in states
                    if st.stage == "grid" and st.arm.kind == kind
                    for s, need in st.needed
                    if seed in need
                ]
                units.append(Unit(f"grid-{kind}", seed, _pending(self, runs)))
        for seed in seeds:
            runs = [
                self.run(st.arm, s, seed, "followup")
                for st in states
                if st.stage == "followup"
                for s, need in st.needed
                if seed in need
            ]
            units.append(Unit("followup", seed, _pending(self, runs)))
        for seed in seeds:
            runs = [
                run
                for st in states
                if st.stage == "cost" and st.pending is not None
                for run in self.cost_pair(st.arm, st.pending, seed)
            ]
            units.append(Unit("cost", seed, _pending(self, runs)))
        if all(st.stage in ("heldout", "done") for st in states):
            units += self.heldout_units(states)
        return [u for u in units if u.runs]

    def heldout_units(self, states: Sequence[ArmState]) -> list[Unit]:
        """One lockstep group a held-out seed, of the runs of every arm of
        ``states`` with a selection that are not recorded yet."""
        units = []
        for seed in self.protocol.heldout_seeds:
            runs = [
                self.run(st.arm, st.selected, seed, "heldout")
                for st in states
                if st.selected is not None
            ]
            units.append(Unit("heldout", seed, _pending(self, runs)))
        return units

    def every_record(self) -> list[dict[str, Any]]:
        """Every record of the case (as last read)."""
        return list(self._index.values())

    def fewest_steps(self, kind: str, seed: int) -> float:
        """The fewest steps to target of any recorded run of ``kind`` on ``seed``."""
        steps = [
            r["result"]["steps_to_target"]
            for (k, _, s), r in self._index.items()
            if k == kind and s == seed and r["result"]["steps_to_target"] is not None
        ]
        return min(steps, default=math.inf)

    def status(self) -> list[str]:
        """One line per arm: its stage, settings tried, and its choice; then what is
        pending now (later stages add runs once these are read) and how many runs
        are in flight with a snapshot."""
        lines = []
        states = [self.state(arm) for arm in self.case.arms]
        for st in states:
            arm = st.arm
            text = f"{arm.name:<22} {st.stage:<9} {len(st.tried)}/{self.protocol.budget} settings"
            if st.pending is not None:
                doing = "pricing" if st.stage == "cost" else "running"
                text += f"; {doing} {st.pending.describe()}"
            if st.selected is not None:
                text += f"; selected {st.selected.describe()}"
            lines.append(text)
        units = self.units()
        runs = sum(len(u.runs) for u in units)
        snapshots = self.store.root / self.case.name / ".snapshots"
        saved = len(list(snapshots.glob("*.pt"))) if snapshots.is_dir() else 0
        lines.append(
            f"pending now: {runs} run(s) in {len(units)} group(s); "
            f"{saved} run(s) in flight saved to resume"
        )
        left, seen = [], set[str]()
        for st in states:  # a run two arms share (a tuned arm's grid) counted once
            known = self.known_left(st)
            left.append((st.arm, self.runs_left(st) - len(known & seen)))
            seen |= known
        paces = self.paces()
        if any(n for _, n in left) and paces:
            overall = statistics.median(t for ts in paces.values() for t in ts)
            need = sum(n * statistics.median(paces.get(arm.kind, [overall])) for arm, n in left)
            lines.append(
                f"left: about {sum(n for _, n in left)} run(s) (each arm's remaining budget on "
                "the selection seeds, then its held-out seeds); at each arm's median run so far "
                f"(all arms' where it has none), about {duration(need)} of one worker"
            )
        return lines

    def paces(self) -> dict[str, list[float]]:
        """The training time (s) of each recorded run, by the runs' arm kind."""
        out: dict[str, list[float]] = {}
        for record in self._index.values():
            out.setdefault(record["arm"], []).append(float(record["result"]["train_time_s"]))
        return out

    def known_left(self, st: ArmState) -> set[str]:
        """The keys of the runs :meth:`runs_left` counts that are known now
        (its settings tried so far, or selected, on the seeds they lack): a
        tuned K-FAC arm's grid is the defaults' arm's, run by the same runs."""
        arm = st.arm
        if st.selected is not None:
            tried, seeds = [st.selected], self.protocol.heldout_seeds
        else:
            tried, seeds = self._unsettled(arm, st.tried), self.protocol.selection_seeds
        return {
            self.run(arm, setting, seed, "").key
            for setting in tried
            for seed in self._missing(arm, setting, seeds)
        }

    def settled(self, arm: Arm, tried: Sequence[Setting]) -> frozenset[Setting]:
        """The settings of ``tried`` the outcomes so far have :func:`settled`."""
        seeds = self.protocol.selection_seeds
        higher = get_task(self.case.task).metric.higher_is_better
        return settled({s: self.outcomes(arm, s, seeds) for s in tried}, len(seeds), higher)

    def _unsettled(self, arm: Arm, tried: Sequence[Setting]) -> list[Setting]:
        """The settings of ``tried`` the outcomes so far have not :func:`settled`."""
        out = self.settled(arm, tried)
        return [s for s in tried if s not in out]

    def runs_left(self, st: ArmState) -> int:
        """About how many runs the arm standing at ``st`` still needs: the rest
        of its budget on the selection seeds, then its held-out seeds (cost
        pairs, which the records call for as the follow-ups arrive, are not
        counted)."""
        arm = st.arm
        if st.selected is not None:  # held out, or being held out
            return len(self._missing(arm, st.selected, self.protocol.heldout_seeds))
        held = len(self.protocol.heldout_seeds)
        seeds = self.protocol.selection_seeds
        missing = sum(len(self._missing(arm, s, seeds)) for s in self._unsettled(arm, st.tried))
        return missing + (self.protocol.budget - len(st.tried)) * len(seeds) + held


def duration(seconds: float) -> str:
    """``seconds`` in the unit a person reads it in: ``40 s``, ``12.5 min``, ``91.3 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def pair_ratio(knob: dict[str, Any], base: dict[str, Any]) -> float:
    """How much a cost pair's knob run took over its base run for the same
    steps: their clocks at the last reading both made (the runs stop at their
    own targets; over one span of steps both paid the same start-up and
    their own factor steps and decompositions in it, under one load). Records
    without a shared reading: the ratio of their amortised times a step."""
    at = {p["step"]: p["time_s"] for p in knob.get("curve") or ()}
    shared = [p for p in base.get("curve") or () if p["step"] in at and p["step"] > 0]
    if shared:
        last = max(shared, key=lambda p: p["step"])
        return float(at[last["step"]]) / float(last["time_s"])
    return _per_step(knob["result"]) / _per_step(base["result"])


def _per_step(result: dict[str, Any]) -> float:
    """A run's amortised wall time a step: every step it ran."""
    return float(result["train_time_s"]) / max(1, int(result["steps"]))


def _pending(campaign: Campaign, runs: Sequence[Run]) -> tuple[Run, ...]:
    """``runs`` without those recorded or listed twice (two arms sharing a run)."""
    seen: set[tuple[str, str, int]] = set()
    out = []
    for run in runs:
        ident = (run.arm.kind, run.key, run.seed)
        if ident in seen or campaign.record(run) is not None:
            continue
        seen.add(ident)
        out.append(run)
    return tuple(out)


@contextlib.contextmanager
def _claim(path: Path) -> Iterator[bool]:
    """Hold the lock file ``path`` (True) unless a live process holds it (False)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            owner = int(path.read_text() or "0")
            os.kill(owner, 0)
            yield False
            return
        except (ValueError, ProcessLookupError, PermissionError, OSError):
            path.unlink(missing_ok=True)  # its owner is gone
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    try:
        yield True
    finally:
        path.unlink(missing_ok=True)


def run_unit(
    campaign: Campaign,
    unit: Unit,
    progress: Progress,
    device: str = "cpu",
    snapshot_every_s: float | None = None,
) -> None:
    """Train one unit in lockstep, writing each run's record as it ends.

    With ``snapshot_every_s``, the unit's runs in flight are saved that often
    (under ``<records>/<case>/.snapshots``), and a unit stopped part-way goes
    on from its runs' snapshots when it is next taken."""
    task = get_task(campaign.case.task)
    data = task.load()
    ctx = DistContext(device=torch.device(device))
    specs = [run.spec for run in unit.runs]
    warm_up(specs, task, data, ctx)
    load_start = load_average()
    snapshots = None
    if snapshot_every_s is not None:
        snapshots = Snapshots(
            campaign.store.root / campaign.case.name / ".snapshots", snapshot_every_s
        )
        for record in campaign.every_record():  # a worker stopped between a record and its discard
            snapshots.discard(record["config"])
    group, lockstep = _group_of(unit, snapshots, device)
    bests: dict[str, float] = {}
    cut = campaign.protocol.cutoff

    def cutoff(i: int, result: RunResult) -> bool:
        run = unit.runs[i]
        if run.role == "heldout" or cut is None:
            return False
        kind = run.arm.kind
        fewest = min(bests.get(kind, math.inf), campaign.fewest_steps(kind, unit.seed))
        return (result.curve[-1].step if result.curve else 0) > cut * fewest

    def on_finish(i: int, result: RunResult) -> None:
        run = unit.runs[i]
        if result.steps_to_target is not None:
            bests[run.arm.kind] = min(bests.get(run.arm.kind, math.inf), result.steps_to_target)
        env = environment(device, load_start, load_average())
        record = train_record(
            case=campaign.case.name,
            arm=run.arm.kind,
            role=run.role,
            result=result,
            env=env,
            group=group,
            lockstep=lockstep,
        )
        campaign.store.write(record)

    labels = [run.label for run in unit.runs]
    train_lockstep(
        specs,
        task,
        data,
        ctx,
        progress,
        labels,
        cutoff=cutoff,
        on_finish=on_finish,
        snapshots=snapshots,
    )
    if snapshots is not None:
        _group_file(snapshots, unit).unlink(missing_ok=True)


def _group_file(snapshots: Snapshots, unit: Unit) -> Path:
    return snapshots.root / f"{unit.name}.group"


def _group_of(unit: Unit, snapshots: Snapshots | None, device: str) -> tuple[str, list[str]]:
    """The label every run of this lockstep group records, and the keys of the
    runs it started with: its name and when it started, so a report can tell
    runs that stepped side by side from runs of one seed trained apart (an arm
    added after the others were held out, a run repeated alone).

    A group stopped part-way and resumed from its snapshots is the same group:
    its label and runs are kept beside the snapshots and read back, so the
    runs that ended before the stop and those that end after it share them.
    A group none of whose runs has a snapshot starts afresh (its runs start
    from their first step, apart from any that ended before)."""
    fresh = (f"{unit.name}@{environment(device)['date']}", [run.key for run in unit.runs])
    if snapshots is None:
        return fresh
    path = _group_file(snapshots, unit)
    if path.exists() and any(snapshots.path(run.spec).exists() for run in unit.runs):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            saved = json.loads(path.read_text())
            return str(saved["label"]), [str(k) for k in saved["lockstep"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"label": fresh[0], "lockstep": fresh[1]}))
    return fresh


def work(
    campaign: Campaign,
    progress: Progress,
    *,
    max_units: int | None = None,
    wait_s: float = 30.0,
    stages: Sequence[str] = ("grid", "followup", "cost", "heldout"),
    device: str = "cpu",
    snapshot_every_s: float | None = None,
) -> int:
    """Take units until none is left (or ``max_units``); return how many this worker ran.

    Units another worker holds are skipped; when every pending unit is held,
    this worker waits ``wait_s`` and looks again (0: return instead)."""
    done = 0
    locks = campaign.store.root / campaign.case.name / ".locks"
    while max_units is None or done < max_units:
        campaign.refresh()
        units = [u for u in campaign.units() if u.stage.split("-")[0] in stages]
        if not units:
            return done
        for unit in units:
            with _claim(locks / f"{unit.name}.lock") as mine:
                if not mine:
                    continue
                campaign.refresh()  # the unit may have been finished meanwhile
                fresh = _pending(campaign, unit.runs)
                if fresh:
                    progress.log(f"unit {unit.name}: {len(fresh)} run(s) in lockstep")
                    run_unit(
                        campaign,
                        Unit(unit.stage, unit.seed, fresh),
                        progress,
                        device,
                        snapshot_every_s,
                    )
                    done += 1
                break
        else:
            if wait_s <= 0:
                return done
            time.sleep(wait_s)
    return done


def selections(campaign: Campaign) -> dict[str, Selection]:
    """Every arm's selected setting (arms still tuning left out), as the task stores it."""
    out = {}
    seeds = campaign.protocol.selection_seeds
    for arm in campaign.case.arms:
        state = campaign.state(arm)
        if state.selected is None:
            continue
        s = state.selected
        out[arm.name] = Selection(
            lr=s.lr,
            warmup_epochs=s.warmup_epochs,
            schedule=s.schedule,
            kfac=dict(s.kfac),
            case=campaign.case.name,
            settings=len(state.tried),
            runs=sum(len(campaign.records(arm, s, seeds)) for s in state.tried),
        )
    return out
