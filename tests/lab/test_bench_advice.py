"""Which K-FAC on which base, at which batch (``kaisa bench summary --advice``):
the fastest K-FAC arm of each base, a lever as much as the defaults, read
from records a test writes, against the optimizer alone and the fastest
first-order arm; a case still being measured is named, not read."""

from __future__ import annotations

import math

import pytest
from tests.lab.fake_campaign import fill, lr_bowl

from kaisa_lab.bench.advice import compared_arms, fastest_kfac, markdown_advice, reading
from kaisa_lab.bench.campaign import Campaign, Run
from kaisa_lab.bench.rows import complete_rows

#: Muon needs half AdamW's steps; K-FAC 0.9× its base's steps, and on Muon's
#: AdamW part only 0.8×, every other lever as many as Muon alone; a K-FAC step
#: on AdamW costs 1.25× a step, on Muon what Muon's does
STEPS = {"adamw-part": 0.8}


def _steps(campaign: Campaign, run: Run) -> int:
    steps = lr_bowl(campaign, run) * (0.5 if run.arm.optimizer == "muon" else 1.0)
    if run.arm.kfac:
        steps *= STEPS.get(run.arm.tag, 1.0 if run.arm.tag else 0.9)
    return int(steps)


def _step_s(run: Run) -> float:
    return 0.0125 if run.arm.kfac and run.arm.optimizer == "adamw" else 0.01


@pytest.fixture(scope="module")
def b512(tmp_path_factory: pytest.TempPathFactory) -> Campaign:
    return fill(tmp_path_factory.mktemp("advice") / "records", "text-lm-b512", _steps, _step_s)


def test_the_fastest_kfac_arm_of_a_base_may_be_a_lever(b512: Campaign) -> None:
    rows = complete_rows(b512)
    assert rows is not None
    best = fastest_kfac(rows, "muon")
    assert best is not None and best.arm.tag == "adamw-part"
    row = next(line for line in markdown_advice([b512]).splitlines() if "| 512 | muon |" in line)
    assert "muon + K-FAC (library defaults, adamw-part)" in row
    # against Muon alone and against the fastest first-order arm (Muon too)
    assert row.count("| 0.80× |") == 2
    assert row.endswith("| faster than every first-order arm |")


def test_a_gpu_comparison_takes_adamw_muon_the_fastest_peer_and_the_fastest_kfac_arm(
    b512: Campaign,
) -> None:
    """Muon is the fastest first-order arm here, so three arms: AdamW, Muon
    and K-FAC on Muon's AdamW part (0.8x Muon's steps at Muon's step)."""
    assert compared_arms(b512) == ["adamw", "muon", "muon+kfac-adamw-part"]


def test_a_base_slower_than_the_best_peer_reads_against_both(b512: Campaign) -> None:
    row = next(line for line in markdown_advice([b512]).splitlines() if "| 512 | adamw |" in line)
    # 0.9x AdamW's steps at 1.25x its step; AdamW needs twice Muon's steps
    assert "| adamw + K-FAC (library defaults) | 1.12× | muon | 2.25× | muon is faster |" in row


def test_a_case_still_being_measured_is_named_not_read(b512: Campaign) -> None:
    record = next((b512.store.root / "text-lm-b512" / "muon").glob("*-s5.json"))
    saved = record.read_bytes()
    record.unlink()
    try:
        b512.refresh()
        text = markdown_advice([b512])
        assert "| text-lm-b512 |" not in text
        assert "Still being measured (not every arm held out): `text-lm-b512`" in text
        assert compared_arms(b512) is None
    finally:
        record.write_bytes(saved)
        b512.refresh()


@pytest.mark.parametrize(
    ("ratio", "text"),
    [
        (0.94, "faster than every first-order arm"),
        (0.96, "a tie with muon"),
        (1.04, "a tie with muon"),
        (1.06, "muon is faster"),
        (0.0, "faster than muon (it misses the target)"),
        (math.inf, "misses the target"),
        (math.nan, "-"),
        (None, "-"),
    ],
)
def test_the_reading_uses_the_summarys_tie_band(ratio: float | None, text: str) -> None:
    assert reading(ratio, "muon") == text


def test_the_command_reads_the_records_it_is_given(
    b512: Campaign, capsys: pytest.CaptureFixture[str]
) -> None:
    from kaisa_lab.cli.main import main

    assert main(["bench", "summary", "--advice", "--records", str(b512.store.root)]) == 0
    out = capsys.readouterr().out
    assert "| text-lm-b512 | 512 | muon | muon + K-FAC (library defaults, adamw-part) |" in out
    # every other case has no record here: named as still being measured
    assert "`text-lm`" in out and "`digits-mlp`" in out
