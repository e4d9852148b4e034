"""Which lever the records make a library default, and why the others are not.

A lever (:mod:`kaisa_lab.levers`) is a change to K-FAC at the library's
defaults, measured beside it on the same base optimizer
(:func:`~kaisa_lab.bench.rows.lever_ratios`: the time to target, paired by
seed).  A default is what every user gets without asking, on every model, so
a lever becomes one only when

- it is a library option: every change it makes is a K-FAC keyword (or the
  lab's ``position_fraction``, the library's ``factor_position_fraction``).
  A lever that also changes the user's optimizer (Muon's Newton–Schulz
  iterations) or which layers K-FAC sees is usage, which README's advice
  states; one that changes what the library cannot do (the Monte Carlo
  Fisher, a partial power) is not built while it does not win;
- it wins on every language-model family at the batch the families train at
  (:data:`FAMILIES`; a tie is not enough: a default changes every user's
  curvature or numerics for nothing measurable), and loses at no other batch
  measured;
- it sets each keyword to the same value on every family: a block size that
  is each model's width is advice for that model, not a default.

:func:`decide` reads one lever; :func:`markdown_defaults` is the table
``kaisa bench summary --defaults`` prints, and the test that holds the
library's defaults to it reads the same decisions.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kaisa.config import KFACConfig
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import Arm
from kaisa_lab.bench.report import across_cell, lever_word
from kaisa_lab.bench.rows import lever_ratios

__all__ = [
    "FAMILIES",
    "Decision",
    "decide",
    "decisions",
    "defaults_line",
    "library_default_of",
    "library_settings",
    "markdown_defaults",
    "same_lever",
]

#: the language-model families a default must win on, each at batch 32
FAMILIES = ("text-lm", "text-cnn", "text-lm-large")
FAMILY_BATCH = 32
#: the lab's run fields that are library keywords under another name
LIBRARY_FIELDS = {"position_fraction": "factor_position_fraction"}
#: run fields that change the user's own setup, not K-FAC's
USAGE_FIELDS = ("muon_ns_steps", "kfac_layers")
#: a block size in a lever's tag: each model's width plus the bias
_BLOCK = re.compile(r"block\d+")


def same_lever(kind: str) -> str:
    """The name one lever goes by on every family: its block size (each
    model's width plus the bias) written ``blockW``."""
    return _BLOCK.sub("blockW", kind)


def library_settings(arm: Arm) -> dict[str, Any]:
    """The K-FAC keywords ``arm``'s lever sets, its ``position_fraction`` as
    the library's ``factor_position_fraction``."""
    run = {LIBRARY_FIELDS[k]: v for k, v in arm.run_lever().items() if k in LIBRARY_FIELDS}
    return {**arm.kfac_lever(), **run}


def _outside(arm: Arm) -> tuple[list[str], list[str]]:
    """The lever's usage fields and its lab-only fields."""
    fields = [k for k in arm.run_lever() if k not in LIBRARY_FIELDS]
    usage = [k for k in fields if k in USAGE_FIELDS]
    return usage, [k for k in fields if k not in USAGE_FIELDS]


@dataclass(frozen=True)
class Decision:
    """What the records make of one lever."""

    lever: str
    #: the library keywords it sets and their values, one set per family
    settings: tuple[tuple[str, Any], ...]
    #: a keyword the families set to different values (each model's own)
    per_model: tuple[str, ...]
    #: ``(case, batch, paired time ratio)`` for each case that measured it
    verdicts: tuple[tuple[str, int, float], ...]
    #: whether the library's default should be its settings
    default: bool
    reason: str


def _names(cases: Sequence[str]) -> str:
    return ", ".join(f"`{c}`" for c in cases)


def _reason(
    verdict: str,
    wins: bool,
    waits: bool,
    outside: tuple[list[str], list[str]],
    settings: Sequence[Any],
    per_model: Sequence[str],
) -> str:
    """What the verdict makes of a lever of this kind (``outside``: its usage
    and lab-only fields)."""
    usage, lab = outside
    if lab:
        what = "to be built" if wins else f"not built (a lab lever: {_names(lab)})"
    elif usage and settings:
        what = f"not read for a default: it also changes {_names(usage)}"
    elif usage:
        what = f"usage, not a default ({_names(usage)}): README's advice"
    elif not settings:
        what = "no library keyword"
    elif per_model and (wins or waits):
        what = f"{'advice' if wins else 'a candidate for advice'}, not a default: " + (
            f"{_names(per_model)} is each model's"
        )
    elif wins:
        what = "the library's default"
    else:
        what = "a candidate default" if waits else "stays an option"
    return f"{verdict}: {what}"


def decide(
    lever: str,
    arms: Sequence[tuple[str, int, Arm]],
    measured: Mapping[str, tuple[str, int, float]],
    apart: Collection[tuple[str, int]] = (),
) -> Decision:
    """The decision on ``lever`` (:func:`same_lever`), run as ``arms`` (``(task,
    global batch, arm)`` for each case that runs it), from ``measured``:
    ``{case: (task, global batch, paired time ratio)}`` for each of those cases
    that held it out.  ``apart``: the ``(task, global batch)`` of cases that held
    it out with no paired seed (its wall clocks do not compare): such a family
    is not paired yet, which a rerun side by side mends, not waiting for runs."""
    values: dict[str, set[str]] = {}
    for _, _, arm in arms:
        for key, value in library_settings(arm).items():
            values.setdefault(key, set()).add(repr(value))
    per_model = tuple(sorted(k for k, v in values.items() if len(v) > 1))
    settings = tuple(sorted(library_settings(arms[0][2]).items()))
    verdicts = tuple((case, batch, r) for case, (_, batch, r) in measured.items())
    # a family's words over every case of it that measured the lever
    families: dict[str, set[str]] = {}
    for task, b, r in measured.values():
        if b == FAMILY_BATCH:
            families.setdefault(task, set()).add(lever_word(r))
    lost = [t for t, w in families.items() if w - {"win", "tie"}]
    lost += [
        c
        for c, (_, b, r) in measured.items()
        if b != FAMILY_BATCH and lever_word(r) not in ("win", "tie")
    ]
    tied = [t for t, w in families.items() if t not in lost and "tie" in w]
    run_on = {task for task, batch, _ in arms if batch == FAMILY_BATCH}
    unpaired = [t for t in FAMILIES if t not in families and (t, FAMILY_BATCH) in apart]
    waits = [t for t in FAMILIES if t not in families and t in run_on and t not in unpaired]
    unrun = [t for t in FAMILIES if t not in families and t not in run_on]
    if lost:
        verdict = f"loses on {_names(lost)}"
    elif tied:
        verdict = f"ties on {_names(tied)}"
    elif waits or unpaired or unrun:
        verdict = "wins where measured" + (f"; waits for {_names(waits)}" if waits else "")
        verdict += f"; not paired on {_names(unpaired)}" if unpaired else ""
        verdict += f"; not run on {_names(unrun)}" if unrun else ""
    else:
        verdict = "wins on every family"
    wins = not (lost or tied or waits or unpaired or unrun)
    usage, lab = outside = _outside(arms[0][2])
    pending = not (lost or tied) and bool(waits or unpaired)
    reason = _reason(verdict, wins, pending, outside, settings, per_model)
    default = wins and not (lab or usage or per_model) and bool(settings)
    return Decision(lever, settings, per_model, verdicts, default, reason)


def decisions(campaigns: Sequence[Campaign]) -> list[Decision]:
    """A decision for each lever the cases run (:func:`same_lever` joins one
    lever's arms across families)."""
    ratios, apart = lever_ratios(campaigns)
    arms: dict[str, list[tuple[str, int, Arm]]] = {}
    measured: dict[str, dict[str, tuple[str, int, float]]] = {}
    unpaired: dict[str, set[tuple[str, int]]] = {}
    for campaign in campaigns:
        case = campaign.case
        for arm in case.arms:
            if not arm.tag:
                continue
            lever = same_lever(arm.kind)
            arms.setdefault(lever, []).append((case.task, case.global_batch, arm))
            ratio = ratios.get(arm.kind, {}).get(case.name)
            if ratio is not None:
                measured.setdefault(lever, {})[case.name] = (case.task, case.global_batch, ratio)
            elif (arm.kind, case.name) in apart:
                unpaired.setdefault(lever, set()).add((case.task, case.global_batch))
    return [
        decide(lever, a, measured.get(lever, {}), unpaired.get(lever, set()))
        for lever, a in arms.items()
    ]


def library_default_of(settings: Sequence[tuple[str, Any]]) -> dict[str, bool]:
    """For each keyword of ``settings``, whether the library's default already
    holds that value (each keyword converted alone, the others at their
    defaults; a value those defaults reject is not the default)."""
    plain = KFACConfig()
    held = {}
    for key, value in settings:
        try:
            given = KFACConfig.from_options(**{key: value})
        except ValueError:
            held[key] = False
        else:
            held[key] = getattr(given, key) == getattr(plain, key)
    return held


def _setting(settings: Sequence[tuple[str, Any]], per_model: Sequence[str]) -> str:
    if not settings:
        return "-"
    return ", ".join(f"`{k}`=each model's" if k in per_model else f"`{k}={v}`" for k, v in settings)


def markdown_defaults(campaigns: Sequence[Campaign]) -> str:
    """The table: each lever, the library keywords it sets, its verdict on
    each case that measured it, and what that makes of it."""
    lines = [
        "| lever | library keywords | measured on | decision |",
        "|---|---|---|---|",
    ]
    made = decisions(campaigns)
    for d in made:
        seen = "; ".join(f"`{c}` {across_cell(r)}" for c, _, r in d.verdicts) or "not held out yet"
        lines.append(f"| {d.lever} | {_setting(d.settings, d.per_model)} | {seen} | {d.reason} |")
    return "\n".join(lines) + "\n\n" + defaults_line(made) + "\n"


def defaults_line(made: Sequence[Decision]) -> str:
    """What the decisions change, in words: the settings they make defaults."""
    earned = [_setting(d.settings, ()) for d in made if d.default]
    if not earned:
        return "The records make no lever a default: the library's defaults stand."
    return "The records make these the library's defaults: " + "; ".join(earned) + "."
