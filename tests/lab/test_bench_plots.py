"""A case's held-out figure: up to 10 arms, the default colours and the legend
over the curves; past 10, 20 distinct colours and a wider figure with the
legend beside the curves (the 12- and 17-arm cases' legends hid the curves)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from tests.lab.fake_campaign import fill

from kaisa_lab.bench.plots import plot_heldout

DPI = 110


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize(("case", "inches"), [("quick", 12), ("text-lm-levers", 15)])
def test_a_case_with_many_arms_gets_a_wider_figure(tmp_path: Path, case: str, inches: int) -> None:
    campaign = fill(tmp_path / "records", case)
    png = tmp_path / f"{case}.png"
    plot_heldout(campaign, png)
    width, _ = _png_size(png)
    assert width == inches * DPI


def test_a_case_without_held_out_records_draws_a_figure_that_says_so(tmp_path: Path) -> None:
    campaign = fill(tmp_path / "records", "quick", rounds=1)
    png = tmp_path / "none.png"
    plot_heldout(campaign, png)
    width, height = _png_size(png)
    assert (width, height) == (8 * DPI, int(1.6 * DPI))
