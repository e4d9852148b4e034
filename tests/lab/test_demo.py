"""``make demo``'s command line, read from the Makefile and run on a tiny budget.

The demo is what a newcomer runs first, so a broken option there (renamed flag,
removed optimizer) must fail the suite. The command is parsed out of the
Makefile's ``demo`` recipe rather than copied here, and run in-process with
``kaisa_lab.cli.main`` (``make demo`` itself would build a virtual environment).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from test_cli import ROOT, assert_valid_png, run_cli

from kaisa_lab.cli.main import build_parser

#: Appended to the demo's own options (argparse keeps the last value): one epoch
#: of 4 steps per arm, no progress bars.
TINY = ["--epochs", "1", "--max-steps-per-epoch", "4", "--quiet"]


def make_recipe(makefile: str, target: str) -> list[str]:
    """The shell lines of ``target``'s recipe, backslash continuations joined."""
    lines = makefile.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:", line)), None
    )
    if start is None:
        raise ValueError(f"no rule {target!r} in the Makefile")
    recipe: list[str] = []
    pending = ""
    for line in lines[start + 1 :]:
        if not line.startswith("\t") and not pending:
            break
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1].rstrip() + " "
            continue
        pending = ""
        recipe.append(text)
    return recipe


def demo_argv(makefile: str) -> list[str]:
    """The arguments given to the ``kaisa`` command in the ``demo`` recipe."""
    for line in make_recipe(makefile, "demo"):
        words = shlex.split(line)
        for i, word in enumerate(words):
            if word.endswith("/bin/kaisa"):
                return words[i + 1 :]
    raise ValueError("the demo recipe runs no kaisa command")


@pytest.fixture(scope="module")
def argv() -> list[str]:
    return demo_argv((ROOT / "Makefile").read_text(encoding="utf-8"))


def test_recipe_parser_joins_continuations_and_stops_at_the_next_rule() -> None:
    makefile = "x: y\n\tfoo a \\\n\t\tb --c\n\n## doc\nother:\n\tbar\n"
    assert make_recipe(makefile, "x") == ["foo a b --c"]
    with pytest.raises(ValueError, match="no rule 'demo'"):
        demo_argv(makefile)


def test_demo_is_the_transformer_lm_against_adamw_and_muon(argv: list[str]) -> None:
    """The issue's demo: text-lm, AdamW and Muon each with K-FAC, a fixed seed, stopped
    at the target, written to runs/demo."""
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    assert args.command == "compare" and args.task == "text-lm"
    assert args.optimizers[:2] == ["adamw", "muon"]
    assert args.stop_at_target and args.seeds == 1 and "--seed" in argv
    assert args.out == Path("runs/demo")


def test_demo_runs_end_to_end(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Makefile's command, on 4 steps per arm: four arms, the JSON, the PNG, the table."""
    runs: list[dict[str, Any]] = run_cli(tmp_path, *argv, *TINY)
    assert [r["name"] for r in runs] == ["adamw", "adamw+kfac", "muon", "muon+kfac"]
    assert all(r["task"] == "text-lm" and r["config"]["seed"] == 0 for r in runs)
    for run in runs[1:]:
        assert run["summary"]["step_cost_s"]["median"] > 0
    assert runs[1]["summary"]["kfac_vs_base"]["base"] == "adamw"
    assert runs[3]["summary"]["kfac_vs_base"]["base"] == "muon"
    assert_valid_png(tmp_path / "results.png")
    text = capsys.readouterr().out
    assert "ms/step" in text and "time vs adamw" in text
    assert "K-FAC on adamw:" in text and "K-FAC on muon:" in text
    assert "1-minute load average" in text or "torch thread" in text
