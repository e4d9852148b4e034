"""The library's defaults come from the levers' records (``kaisa bench summary
--defaults``): a lever becomes a default only where it is a library option that
wins on every language-model family and loses at no other batch, at one
setting for every model; the library's actual defaults are held to the
decisions the committed records give."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import kaisa_lab.bench.defaults as defaults_module
from kaisa_lab.bench.campaign import Campaign
from kaisa_lab.bench.cases import Arm, lever_cases
from kaisa_lab.bench.defaults import (
    FAMILIES,
    decide,
    decisions,
    defaults_line,
    library_default_of,
    same_lever,
)
from kaisa_lab.bench.plots import across_points
from kaisa_lab.bench.records import RecordStore
from kaisa_lab.bench.rows import lever_ratios
from kaisa_lab.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RECORDS = RecordStore(ROOT / "benchmarks" / "records")

POSITIONS = Arm("muon", kfac=True, lever=(("position_fraction", 0.125),), tag="pos0.125")


def _blocks(dim: int) -> Arm:
    lever = (("kfac.max_factor_dim", dim), ("kfac.large_factor", "block"))
    return Arm("muon", kfac=True, lever=lever, tag=f"block{dim}")


def _everywhere(arm: Arm) -> list[tuple[str, int, Arm]]:
    return [(task, 32, arm) for task in FAMILIES]


def _measured(*ratios: float, b512: float | None = None) -> dict[str, tuple[str, int, float]]:
    out = {f"{t}-case": (t, 32, r) for t, r in zip(FAMILIES, ratios, strict=False)}
    if b512 is not None:
        out["text-lm-b512"] = ("text-lm", 512, b512)
    return out


def test_a_library_option_that_wins_on_every_family_is_the_default() -> None:
    d = decide("pos", _everywhere(POSITIONS), _measured(0.9, 0.9, 0.9))
    assert d.default and d.reason == "wins on every family: the library's default"
    assert d.settings == (("factor_position_fraction", 0.125),)


@pytest.mark.parametrize(
    ("ratios", "b512", "reason"),
    [
        ((0.9, 0.97, 0.9), None, "ties on `text-cnn`: stays an option"),
        ((0.9, 0.9, 1.1), None, "loses on `text-lm-large`: stays an option"),
        ((0.9, 0.9, 0.9), 1.1, "loses on `text-lm-b512`: stays an option"),
        ((0.9, 0.9), None, "wins where measured; waits for `text-lm-large`: a candidate default"),
    ],
)
def test_a_tie_a_loss_or_a_family_not_yet_measured_is_not_a_default(
    ratios: tuple[float, ...], b512: float | None, reason: str
) -> None:
    d = decide("pos", _everywhere(POSITIONS), _measured(*ratios, b512=b512))
    assert not d.default
    assert d.reason == reason


def test_a_win_at_another_batch_does_not_stand_in_for_a_family() -> None:
    d = decide("pos", [("text-lm", 512, POSITIONS)], {"b512": ("text-lm", 512, 0.8)})
    assert not d.default
    assert "not run on `text-lm`, `text-cnn`, `text-lm-large`: stays an option" in d.reason


def test_a_setting_each_model_chooses_is_advice_not_a_default() -> None:
    arms = [("text-lm", 32, _blocks(129)), ("text-cnn", 32, _blocks(129))]
    arms.append(("text-lm-large", 32, _blocks(257)))
    assert len({same_lever(a.kind) for _, _, a in arms}) == 1
    d = decide("blocks", arms, _measured(0.9, 0.9, 0.9))
    assert not d.default and d.per_model == ("max_factor_dim",)
    assert d.reason.endswith("advice, not a default: `max_factor_dim` is each model's")


@pytest.mark.parametrize(
    ("lever", "what"),
    [
        ((("muon_ns_steps", 3),), "usage, not a default (`muon_ns_steps`): README's advice"),
        (
            (("muon_ns_steps", 3), ("kfac.precondition_dtype", "bfloat16")),
            "not read for a default: it also changes `muon_ns_steps`",
        ),
        ((("eigen_power", 0.5),), "to be built"),
    ],
)
def test_usage_and_lab_levers_are_not_defaults(
    lever: tuple[tuple[str, object], ...], what: str
) -> None:
    arm = Arm("muon", kfac=True, lever=lever, tag="x")
    d = decide("x", _everywhere(arm), _measured(0.9, 0.9, 0.9))
    assert not d.default
    assert d.reason == f"wins on every family: {what}"


def test_the_library_defaults_are_the_decisions_the_records_give() -> None:
    """Every keyword a lever the records make a default sets is at the lever's
    value; every other keyword a lever sets is at none of the levers' values
    (a default changed by hand, without the records that earn it, fails here)."""
    made = decisions([Campaign(c, RECORDS) for c in lever_cases()])
    assert {d.lever for d in made} >= {"muon+kfac-pos0.125", "muon+kfac-blockW-pos0.125-bf16"}
    earned = {k for d in made if d.default for k, _ in d.settings}
    for d in made:
        for key, is_default in library_default_of(d.settings).items():
            if d.default:
                assert is_default, f"{d.lever}: the records make {key} a default"
            elif key not in earned:
                assert not is_default, f"{key} is at {d.lever}'s value: {d.reason}"


def test_the_command_prints_every_lever(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "summary", "--defaults", "--records", str(RECORDS.root)]) == 0
    out = capsys.readouterr().out
    kinds = {same_lever(a.kind) for c in lever_cases() for a in c.arms if a.tag}
    rows = [line for line in out.splitlines() if line.startswith("| ") and "+kfac" in line]
    assert {row.split(" | ")[0].removeprefix("| ") for row in rows} == kinds
    # the last line says what the decisions change, in words
    made = decisions([Campaign(c, RECORDS) for c in lever_cases()])
    assert out.rstrip().splitlines()[-1] == defaults_line(made)


def test_the_closing_line_names_the_settings_the_records_make_defaults() -> None:
    won = decide("pos", _everywhere(POSITIONS), _measured(0.9, 0.9, 0.9))
    tied = decide("pos", _everywhere(POSITIONS), _measured(0.9, 0.97, 0.9))
    assert defaults_line([tied]) == (
        "The records make no lever a default: the library's defaults stand."
    )
    assert defaults_line([won, tied]) == (
        "The records make these the library's defaults: `factor_position_fraction=0.125`."
    )


def test_the_levers_plot_draws_every_finite_ratio_the_table_gives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    campaigns = [Campaign(c, RECORDS) for c in lever_cases()]
    ratios, _ = lever_ratios(campaigns)
    points = across_points(campaigns)
    assert points and {(k, c) for k, c, _ in points} == {
        (k, c) for k, by in ratios.items() for c, r in by.items() if math.isfinite(r) and r > 0
    }
    png = tmp_path / "levers.png"
    argv = ["bench", "summary", "--levers", "--records", str(RECORDS.root), "--plot", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["bench", "summary", "--advice", "--plot", str(tmp_path / "x.png")])
    assert "argument --plot" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_family_measured_twice_reads_its_worse_verdict() -> None:
    measured = _measured(0.9, 0.9, 0.9)
    measured["text-lm-other"] = ("text-lm", 32, 1.1)  # a second text-lm case: a loss
    d = decide("pos", _everywhere(POSITIONS), measured)
    assert not d.default and d.reason == "loses on `text-lm`: stays an option"


def test_a_family_held_out_apart_reads_not_paired_not_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A family whose lever and reference arms were held out in groups apart
    has records but no paired ratio: its verdict says so (a rerun side by side
    mends it), it does not read as waiting for runs, and it is no default."""
    d = decide("pos", _everywhere(POSITIONS), _measured(0.9, 0.9), {("text-lm-large", 32)})
    assert not d.default
    assert d.reason == "wins where measured; not paired on `text-lm-large`: a candidate default"
    # apart at another batch leaves a family unmeasured at 32 waiting
    d = decide("pos", _everywhere(POSITIONS), _measured(0.9, 0.9), {("text-lm-large", 512)})
    assert d.reason == "wins where measured; waits for `text-lm-large`: a candidate default"
    # decisions() hands lever_ratios' apart pairs on, by case and lever
    campaigns = [Campaign(c, RECORDS) for c in lever_cases()]
    ratios, _ = lever_ratios(campaigns)
    case = next(c for c in lever_cases() if c.global_batch == 32)
    arm = next(a for a in case.arms if a.tag)
    ratios.get(arm.kind, {}).pop(case.name, None)
    monkeypatch.setattr(
        defaults_module, "lever_ratios", lambda _: (ratios, {(arm.kind, case.name)})
    )
    made = {d.lever: d for d in decisions(campaigns)}
    assert f"not paired on `{case.task}`" in made[same_lever(arm.kind)].reason
