"""The suite's cost cases: each runs quick, writes records of the one schema, and renders.

No speed is asserted (the machine is shared): what is checked is that every
arm was measured, the records hold what a report needs, and the tables
render from the records alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kaisa_lab.bench.records import SCHEMA, RecordStore
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import TIMING_CASES, latest
from kaisa_lab.cli.main import main


def test_interleave_takes_turns_and_times_every_step() -> None:
    order: list[str] = []
    timed = interleave(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")},
        rounds=3,
        block=2,
        warmup=1,
    )
    assert order == ["a", "a", "b", "b"] * 4  # one warm-up round, then three
    assert {name: len(t.samples_ms) for name, t in timed.items()} == {"a": 6, "b": 6}
    assert all(t.median_ms >= 0 for t in timed.values())
    with pytest.raises(ValueError, match="rounds >= 1"):
        interleave({"a": lambda: None}, rounds=0)


def test_the_gram_case_measures_both_forms_on_every_shape(tmp_path: Path) -> None:
    assert main(["bench", "run", "gram", "--quick", "--records", str(tmp_path)]) == 0
    records = latest(RecordStore(tmp_path), "gram")
    shapes = TIMING_CASES["gram"].quick["shapes"]
    assert len(records) == 2 * len(shapes)
    assert {r["schema"] for r in records} == {SCHEMA} and {r["kind"] for r in records} == {"timing"}
    assert all(r["result"]["median_ms"] > 0 for r in records)
    assert {r["config"]["form"] for r in records} == {"one product", "kaisa gram"}
    assert records[0]["environment"]["versions"]["torch"]


def test_a_cost_case_refuses_an_unknown_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "run", "gram", "--option", "repeats=3", "--records", str(tmp_path)])
    err = capsys.readouterr().err
    assert "argument --option" in err and "repeats" in err and "rounds" in err


def test_ab_times_a_case_on_two_trees_in_turns(tmp_path: Path) -> None:
    from kaisa_lab.bench.ab import _ROOT, ab, markdown_ab

    records = ab("gram", str(_ROOT), rounds=2, arguments=["--quick"], store=RecordStore(tmp_path))
    arms = {r["arm"] for r in records}
    assert len(arms) == 2 * len(TIMING_CASES["gram"].quick["shapes"])
    for r in records:
        res = r["result"]
        assert len(res["before_rounds_ms"]) == len(res["after_rounds_ms"]) == 2
        assert res["ratio"] == pytest.approx(res["after_ms"] / res["before_ms"])
    assert len(list(tmp_path.glob("gram-ab/*/*.json"))) == len(records)
    assert markdown_ab(records).startswith("| arm | before (ms) |")


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("rounds=-1", "expected an integer >= 1"),
        ("rounds=2.5", "expected an integer"),
        ("rounds=true", "expected an integer"),
        ("shapes=abc", "expected a JSON list"),
    ],
)
def test_a_cost_case_refuses_an_option_of_the_wrong_kind_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, expected: str
) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "run", "gram", "--quick", "--option", option, "--records", str(tmp_path)])
    err = capsys.readouterr().err
    assert "argument --option" in err and expected in err
    assert not tmp_path.joinpath("gram").exists()  # refused before any measurement


def test_option_kinds_follow_the_defaults() -> None:
    from kaisa_lab.bench.timing import _option_problem

    assert _option_problem("warmup", 0, 5) == ""  # a warm-up may be none
    assert _option_problem("tflops", 14, 14.0) == ""  # an integer is a number
    assert "finite" in _option_problem("tflops", float("nan"), 14.0)
    assert "true or false" in _option_problem("timed", 1, True)
    assert _option_problem("settings", "anything", None) == ""  # None: any value
    assert "a text or null" in _option_problem("backend", 3, "inductor")
    assert _option_problem("reference_src", None, "/some/path") == ""  # null: off
    assert "a JSON object" in _option_problem("links", [], {"a": 1})
    assert _option_problem("kfac_kwargs", "damping=0.3", {}) == ""  # the case parses it


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["bench", "run", "gram", "--quick", "--device", "cuda"], "--device"),
        (["bench", "ab", "gram", "--before", "no-such-revision-x"], "--before"),
        (["bench", "ab", "gram", "--before", "HEAD", "--after", "/"], "--after"),
        (["bench", "ab", "gram", "--before", "HEAD", "--option", "rounds=0"], "--option"),
        (["bench", "report", "gram", "--records", "/no/such/folder"], "--records"),
    ],
)
def test_cost_case_usage_errors_name_their_argument(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_revisions_of_an_ab() -> None:
    from kaisa_lab.bench.ab import _ROOT, revision_problem

    assert revision_problem(str(_ROOT)) == ""  # a folder holding src/kaisa
    assert revision_problem("HEAD") == ""
    assert "neither" in revision_problem("no-such-revision-x")
    empty_tree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree: no commit
    assert "neither" in revision_problem(empty_tree)
