"""The tuning protocol every arm of a comparison goes through, as pure functions.

An arm is an optimizer, with or without K-FAC. Each arm gets the same budget
of settings (:attr:`Protocol.budget`), each trained on the same selection
seeds, over the same axes:

1. **grid**: ``lr_points`` learning rates on a log grid (factor ``lr_step``
   apart, centred on the arm's prior lr) × the case's warm-ups (none, and the
   task's), at the case's schedule;
2. **follow-ups**, the rest of the budget, one at a time: while the best
   setting so far sits at an edge of the lrs tried at its warm-up, the next lr
   beyond that edge; otherwise the arm's own knobs at the best lr and warm-up
   (a tuned K-FAC arm: damping, intervals), then (or, for an arm without
   knobs, at once) the lrs half a grid step either side of the best, then a
   quarter step, so that every arm spends its whole budget;
3. **selection**: the setting with the fewest median steps to target over
   the selection seeds (a run that misses the target counts as infinitely
   many; ties go to the fewer mean steps, then the better median final
   metric); a setting that changes a step's work (a K-FAC interval,
   :data:`WORK_KNOBS`) has its steps weighed by its **step cost**: it and
   the same setting without the knob run side by side in one lockstep group
   on each selection seed (a *cost pair*), and the median over the seeds of
   their clocks' ratio at the last step both reached; where no setting
   reaches the target on most seeds, the best median final metric. A
   setting whose first seeds already put it behind another setting, whatever
   its remaining seeds give, runs no more of them (:func:`settled`): those
   runs could not change the choice. Wall
   time decides nothing across groups: a grid's ten settings step in one
   group and the follow-ups in others, under other loads and caches, and
   the same setting's step has been timed 0.7–2× apart that way;
4. **held-out**: the selected setting on the held-out seeds, which played no
   part in the choice; only those runs are reported.

A library-defaults arm (K-FAC at its defaults) has no knobs: only the base
optimizer's lr and warm-up are tuned. Nothing here runs anything: the
campaign (:mod:`kaisa_lab.bench.campaign`) asks these functions what to run
next, given the outcomes so far.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "WORK_KNOBS",
    "Outcome",
    "Protocol",
    "Setting",
    "best",
    "fastest",
    "followup",
    "grid",
    "settled",
    "work_base",
]


@dataclass(frozen=True)
class Setting:
    """What tuning varies for one arm: lr, warm-up, schedule and K-FAC keywords."""

    lr: float
    warmup_epochs: float
    schedule: str
    kfac: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        text = f"lr {self.lr:.3g}, warm-up {self.warmup_epochs:g} ep, {self.schedule}"
        return text + "".join(f", {k} {v}" for k, v in self.kfac)


@dataclass(frozen=True)
class Outcome:
    """One run of a setting on one seed: what the protocol reads of its record."""

    time_s: float | None  # time to target on the run's clock; None: not reached
    steps: int | None
    final_metric: float | None


@dataclass(frozen=True)
class Protocol:
    """The numbers of the protocol (the same for every arm of a case)."""

    selection_seeds: tuple[int, ...] = (0, 1, 2)
    heldout_seeds: tuple[int, ...] = (5, 6, 7, 8, 9)
    lr_points: int = 5
    lr_step: float = 2.0
    #: settings per arm: the grid, then follow-ups up to this many
    budget: int = 12
    #: a tuning run stops once its steps pass this many times the fewest steps to
    #: target of any run of its own kind on its seed (its group's or recorded):
    #: steps, as the selection reads, so no group's load cuts a run sooner
    cutoff: float | None = 3.0
    warmups_note: str = field(default="none, and the task's", compare=False)

    @property
    def deciding_seeds(self) -> tuple[int, ...]:
        """The selection seeds every setting runs (the first half, rounded up):
        once a setting has them, its median steps over all the selection
        seeds is bounded, and the other seeds run only where the bounds leave
        it a chance of being selected (:func:`settled`)."""
        return self.selection_seeds[: (len(self.selection_seeds) + 1) // 2]

    def __post_init__(self) -> None:
        if set(self.selection_seeds) & set(self.heldout_seeds):
            raise ValueError("selection and held-out seeds must be disjoint")
        if self.lr_points < 3 or self.lr_step <= 1.0:
            raise ValueError("need lr_points >= 3 and lr_step > 1")


def grid(
    protocol: Protocol, prior_lr: float, warmups: Sequence[float], schedule: str
) -> list[Setting]:
    """The grid of an arm: ``lr_points`` lrs centred on ``prior_lr`` × ``warmups``."""
    middle = (protocol.lr_points - 1) / 2
    lrs = [_round(prior_lr * protocol.lr_step ** (i - middle)) for i in range(protocol.lr_points)]
    return [Setting(lr, w, schedule) for w in warmups for lr in lrs]


def _round(lr: float) -> float:
    """Four significant digits: grids stay readable and equal settings compare equal."""
    return float(f"{lr:.4g}")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.inf


#: K-FAC keywords whose value changes the work of a step (a factor step or a
#: decomposition more or less often): a setting that sets one is weighed by its
#: measured step cost (a cost pair), every other knob (lr, warm-up, damping)
#: leaves a step's work as it is
WORK_KNOBS = ("factor_update_steps", "inv_update_steps")


def work_base(setting: Setting) -> Setting | None:
    """``setting`` without its :data:`WORK_KNOBS` (what its step cost is timed
    against), or None where it sets none (its steps cost the arm's own)."""
    kept = tuple((k, v) for k, v in setting.kfac if k not in WORK_KNOBS)
    if kept == setting.kfac:
        return None
    return Setting(setting.lr, setting.warmup_epochs, setting.schedule, kept)


def _score(
    outcomes: Sequence[Outcome], higher_is_better: bool, cost: float = 1.0
) -> tuple[float, float, float]:
    """Sort key of a setting: (median steps, mean steps, minus quality), the
    steps weighed by ``cost``."""
    steps = [float(o.steps) if o.steps is not None else math.inf for o in outcomes]
    finals = [o.final_metric for o in outcomes if o.final_metric is not None]
    finals = [f for f in finals if math.isfinite(f)]
    quality = _median(finals) if finals else (-math.inf if higher_is_better else math.inf)
    mean = statistics.fmean(steps) if steps else math.inf
    return (_median(steps) * cost, mean * cost, -quality if higher_is_better else quality)


def _complete(
    results: Mapping[Setting, Sequence[Outcome]],
) -> dict[Setting, Sequence[Outcome]]:
    """The settings with an outcome on every seed (a half-run setting would
    otherwise win or lose by the seeds it skipped)."""
    seeds = max((len(o) for o in results.values()), default=0)
    return {s: o for s, o in results.items() if o and len(o) == seeds}


def best(
    results: Mapping[Setting, Sequence[Outcome]],
    higher_is_better: bool,
    costs: Mapping[Setting, float] | None = None,
) -> Setting | None:
    """The selected setting: fewest median steps (weighed by ``costs`` where a
    setting changes a step's work), then mean steps, then final metric.

    Only settings with an outcome on every seed compete. A setting with
    :data:`WORK_KNOBS` needs its cost in ``costs`` (the campaign times a cost
    pair before it selects)."""
    complete = _complete(results)
    costs = costs or {}
    missing = [s for s in complete if work_base(s) is not None and s not in costs]
    if missing:
        raise ValueError(f"costs: no step cost for {missing[0].describe()} (it sets {WORK_KNOBS})")
    ranked = sorted(
        complete,
        key=lambda s: (
            _score(complete[s], higher_is_better, costs.get(s, 1.0)),
            s.lr,
            s.warmup_epochs,
        ),
    )
    return ranked[0] if ranked else None


def settled(
    results: Mapping[Setting, Sequence[Outcome]], seeds: int, higher_is_better: bool = False
) -> frozenset[Setting]:
    """The settings of ``results`` that :func:`best` cannot select, whatever
    their outcomes on the seeds they lack (of ``seeds`` selection seeds).

    A setting's median steps over all the seeds lies between the median of
    its outcomes with every missing seed at 0 steps and the median with every
    missing seed a miss. A setting loses to another on any outcome of its
    missing seeds, ties and tie-breaks included, where its least possible
    median is above the other's greatest possible median; or where it misses
    the target on most seeds whatever its missing seeds give (so its median
    and mean steps are infinite and the final metric decides between it and
    any setting that misses as often) and its best possible median final
    metric is worse than the other's worst possible one. Its missing runs
    could not change the choice. Only settings that leave a step's work as
    it is (:func:`work_base` None) are compared: the others' steps are
    weighed by a step cost the bounds do not know."""
    sign = -1.0 if higher_is_better else 1.0
    bounds = {}
    for setting, outcomes in results.items():
        if work_base(setting) is not None:
            continue
        missing = max(seeds - len(outcomes), 0)
        steps = [float(o.steps) if o.steps is not None else math.inf for o in outcomes]
        # the final metric as best() sorts it (lower first); a non-finite or
        # absent one is left out of the median there, and no finite one at all
        # sorts last
        finals = [sign * o.final_metric for o in outcomes if o.final_metric is not None]
        finals = [f for f in finals if math.isfinite(f)]
        # (a missing seed's final left out of the median lies between the two)
        bounds[setting] = (
            _median(steps + [-math.inf] * missing),  # least median steps
            _median(steps + [math.inf] * missing),  # greatest
            _median(finals + [-math.inf] * missing) if finals or missing else math.inf,
            _median(finals + [math.inf] * missing),  # worst median final
        )
    ceiling = min((b[1] for b in bounds.values()), default=math.inf)
    metric_ceiling = min((b[3] for b in bounds.values()), default=math.inf)
    # a NaN bound (an even count of seeds: a miss beside a missing seed)
    # compares false: such a setting is not settled by it
    return frozenset(
        s
        for s, (low, _, best_final, _) in bounds.items()
        if low > ceiling or (low == math.inf and best_final > metric_ceiling)
    )


def fastest(results: Mapping[Setting, Sequence[Outcome]]) -> Setting | None:
    """The setting with the lowest median wall time to target: a check beside
    the rule, not the rule (each group's clock ran under its own load)."""
    complete = _complete(results)

    def key(s: Setting) -> tuple[float, float, float]:
        times = [o.time_s if o.time_s is not None else math.inf for o in complete[s]]
        return (_median(times), s.lr, s.warmup_epochs)

    ranked = sorted(complete, key=key)
    return ranked[0] if ranked else None


def followup(
    protocol: Protocol,
    tried: Sequence[Setting],
    chosen: Setting,
    knobs: Sequence[Mapping[str, Any]],
) -> Setting | None:
    """The next setting to try after ``tried`` (all with complete outcomes), or None.

    ``chosen`` is :func:`best` of ``tried``; ``knobs`` the arm's own K-FAC
    variants (empty for an arm without knobs)."""
    if len(tried) >= protocol.budget:
        return None
    same = sorted({s.lr for s in tried if _same_but_lr(s, chosen)})
    if chosen.lr == same[0] or chosen.lr == same[-1]:
        factor = protocol.lr_step if chosen.lr == same[-1] else 1 / protocol.lr_step
        return _replace(chosen, lr=_round(chosen.lr * factor))
    knob_variants = [_with_kfac(chosen, knob) for knob in knobs]
    refinements = [
        _replace(chosen, lr=_round(chosen.lr * protocol.lr_step**f)) for f in REFINE_STEPS
    ]
    for candidate in [*knob_variants, *refinements]:
        if not any(_close(candidate, s) for s in tried):
            return candidate
    return None


def _close(a: Setting, b: Setting) -> bool:
    """The same setting, lrs equal to within rounding (0.009998 is the grid's 0.01)."""
    return _same_but_lr(a, b) and a.kfac == b.kfac and math.isclose(a.lr, b.lr, rel_tol=1e-2)


#: the lrs a refinement tries around the best, in grid steps: half a step either
#: side, then a quarter (a refined best's half steps are grid points already tried)
REFINE_STEPS = (0.5, -0.5, 0.25, -0.25)


def _same_but_lr(a: Setting, b: Setting) -> bool:
    """Whether ``a`` lies on ``b``'s lr axis: the same warm-up and schedule (a
    knob variant, tried at an lr inside the grid, counts at that lr)."""
    return (a.warmup_epochs, a.schedule) == (b.warmup_epochs, b.schedule)


def _replace(setting: Setting, lr: float) -> Setting:
    return Setting(lr, setting.warmup_epochs, setting.schedule, setting.kfac)


def _with_kfac(setting: Setting, knob: Mapping[str, Any]) -> Setting:
    merged = {**dict(setting.kfac), **knob}
    return Setting(
        setting.lr, setting.warmup_epochs, setting.schedule, tuple(sorted(merged.items()))
    )
