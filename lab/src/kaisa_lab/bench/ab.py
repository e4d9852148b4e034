"""Before and after a change: one cost case on two versions of the library, taking turns.

One run of a cost case moves by ±10–20 % between minutes on a shared
machine, so a code change is judged on several runs of each version,
interleaved: fresh interpreters, before, after, before, after, …, each with
its version's ``src`` first on the path. The suite itself (the case, the
models, the timer) is this checkout's on both sides, so both time the same
thing. Per arm: the median over rounds of each round's median step time,
and after/before.

    kaisa bench ab step-cost --before HEAD~3 --rounds 5 --quick
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kaisa_lab.bench.records import SCHEMA, RecordStore, config_key, environment, load_average
from kaisa_lab.bench.timer import alternate

__all__ = ["ab", "library_tree", "markdown_ab", "revision_problem"]

#: the repository this module lives in, and its suite (lab/src), used on both sides
_ROOT = Path(__file__).resolve().parents[4]


def library_tree(rev: str, into: Path) -> Path:
    """A folder holding the library's ``src`` at ``rev``: ``rev`` itself if it is a folder
    with ``src/kaisa``, else the revision's ``src`` extracted from git into ``into``."""
    given = Path(rev)
    if (given / "src" / "kaisa").is_dir():
        return given
    into.mkdir(parents=True, exist_ok=True)
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", rev, "src"], cwd=_ROOT, stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def revision_problem(rev: str) -> str:
    """Why ``rev`` cannot be a side of an A/B ('' when it can): it must be a
    folder holding ``src/kaisa`` or a git revision of this repository that has
    ``src``; checked before any process is started, so a typo is a usage error,
    not a failed ``git archive`` after the other side's setup."""
    if (Path(rev) / "src" / "kaisa").is_dir():
        return ""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        cwd=_ROOT,
        capture_output=True,
    )
    if found.returncode != 0:
        return "neither a folder holding src/kaisa nor a git revision of this repository"
    has_src = subprocess.run(
        ["git", "cat-file", "-e", f"{rev}:src"], cwd=_ROOT, capture_output=True
    )
    return "" if has_src.returncode == 0 else "a git revision without src/"


def ab(
    case: str,
    before: str,
    *,
    after: str | None = None,
    rounds: int = 5,
    arguments: Sequence[str] = (),
    store: RecordStore | None = None,
) -> list[dict[str, Any]]:
    """Time ``case`` on ``before`` and ``after`` (default: this tree) in turns.

    ``arguments`` go to ``kaisa bench run`` on both sides (``--quick``,
    ``--option``). Returns one record per arm (``case`` ``<case>-ab``), also
    written to ``store`` when given."""
    load_start = load_average()
    with tempfile.TemporaryDirectory(prefix="kaisa-ab-") as scratch:
        root = Path(scratch)
        trees = {
            "before": library_tree(before, root / "before"),
            "after": library_tree(after, root / "after") if after else _ROOT,
        }
        sides, env = {}, {}
        for side, tree in trees.items():
            records = root / f"records-{side}"
            sides[side] = [
                "-m", "kaisa_lab", "bench", "run", case, "--records", str(records),
                "--print-json", *arguments,
            ]  # fmt: skip
            env[side] = {"PYTHONPATH": f"{tree / 'src'}:{_ROOT / 'lab' / 'src'}"}
        runs = alternate(sides, rounds=rounds, env=env, cwd=_ROOT)
    per_arm: dict[str, dict[str, list[float]]] = {}
    for side, documents in runs.items():
        for document in documents:
            for record in document:
                cell = per_arm.setdefault(record["arm"], {"before": [], "after": []})
                cell[side].append(record["result"]["median_ms"])
    env_record = environment("cpu", load_start, load_average())
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = []
    for arm, cell in per_arm.items():
        b, a = statistics.median(cell["before"]), statistics.median(cell["after"])
        config = {"case": case, "before": before, "after": after or "HEAD", "args": list(arguments)}
        record = {
            "schema": SCHEMA,
            "kind": "timing",
            "case": f"{case}-ab",
            "arm": arm,
            "role": "ab",
            "seed": 0,
            "run": stamp,
            "key": config_key(config),
            "config": config,
            "result": {
                "before_ms": b,
                "after_ms": a,
                "ratio": a / b if b > 0 else None,
                "before_rounds_ms": cell["before"],
                "after_rounds_ms": cell["after"],
            },
            "environment": env_record,
        }
        if store is not None:
            store.write(record)
        out.append(record)
    return out


def markdown_ab(records: Sequence[Mapping[str, Any]]) -> str:
    """Per arm: before, after (medians over rounds, ms) and after/before."""
    lines = ["| arm | before (ms) | after (ms) | after / before |", "|---|---|---|---|"]
    for r in records:
        res = r["result"]
        ratio = "-" if res["ratio"] is None else f"{res['ratio']:.3f}"
        lines.append(f"| {r['arm']} | {res['before_ms']:.3f} | {res['after_ms']:.3f} | {ratio} |")
    return "\n".join(lines) + "\n"
