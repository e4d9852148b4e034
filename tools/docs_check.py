"""Docs that cannot go stale: re-run the commands behind README.md and docs/**/*.md.

A region of a markdown file that a command prints is fenced by two HTML
comments, which name the command::

    <!-- generated code: kaisa plan --model kaisa_lab.zoo:resnet50 --world-size 64 -->
    ```
    ...what the command printed...
    ```
    <!-- end generated -->

Flags between ``generated`` and the colon: ``code`` puts the output in a
``` block (without it the output is markdown, e.g. a table, and goes in
as it is); ``slow`` marks a command of more than a few seconds, which the
quick check (``--skip-slow``, the fast test) leaves to the full one.  A
command starts with ``kaisa`` (the CLI of this tree: kaisa-lab's, run as
``python -m kaisa_lab``) or ``python`` (this interpreter), runs in a scratch
folder that links to the repository's files (so ``runs/`` outputs land there,
not in the tree), with this tree's ``src`` and ``lab/src`` first on the path,
and only its standard output counts.  The region must equal that output
exactly, line by line after stripping trailing spaces: a number edited by
hand, or a change to the code that moves one, fails the check with a diff.
Only deterministic outputs belong in a region (plans, bytes, memory,
modelled time), never timings.

Whole files can be generated too (:data:`FILES`: a cost model the docs'
commands read).

    python tools/docs_check.py            # check; exit 1 with a diff on drift
    python tools/docs_check.py --write    # rewrite every region from its command
    python tools/docs_check.py --skip-slow
    python tools/docs_check.py --jobs 4   # commands at once (default: the cores, at most 8)

Outputs are cached under ``.cache/docs-check`` by command and a digest of the
sources that could change them (``src/``, ``lab/src/``, ``benchmarks/``, this
file, the files the command names, the records under ``benchmarks/records/`` of
every case the command names, e.g. ``kaisa bench report plan-paper`` (all of them
for ``kaisa bench summary``, which reads every family's), the torch
version): a re-run without a change to those is instant, and any change to
them runs the command again.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the markdown files whose regions are checked (globs, relative to the root): the
#: README and every page of the documentation site, in any folder under docs/
DOCS = ("README.md", "docs/**/*.md")
#: whole files a command prints, relative to the root
FILES = {"docs/plan-paper-costs.json": "kaisa bench report plan-paper --table costs"}
MARKER = re.compile(r"^<!-- generated(?P<flags>(?: [a-z]+)*): (?P<command>.+?) -->\s*$")
END = "<!-- end generated -->"
FLAGS = {"code", "slow"}
#: what a region's command may start with, and what runs it
RUNNERS = {"kaisa": [sys.executable, "-m", "kaisa_lab"], "python": [sys.executable]}
#: the source folders put first on a command's path: the library and kaisa-lab
PATHS = ("src", "lab/src")
#: what the digest of the sources covers (besides the files a command names)
SOURCES = (*PATHS, "benchmarks")
#: the most commands run at once by default: each is a process that imports
#: torch (a few hundred MiB), so a many-core machine is not filled with them
MAX_JOBS = 8
#: the benchmark suite's records (one folder per case): a command that names a
#: case (``kaisa bench report CASE``) renders its JSON records, so they are digested too
RECORDS = "benchmarks/records"


@dataclass(frozen=True)
class Region:
    """Lines ``start`` (the marker) … ``end`` (the end marker) of ``path``."""

    path: Path
    start: int
    end: int
    command: str
    flags: frozenset[str]

    @property
    def slow(self) -> bool:
        return "slow" in self.flags

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.start + 1}"


def find_regions(path: Path, text: str | None = None) -> list[Region]:
    """Every generated region of one markdown file (of ``text``, if given), in order."""
    lines = (path.read_text() if text is None else text).splitlines()
    regions, open_at = [], None
    for i, line in enumerate(lines):
        match = MARKER.match(line)
        if match:
            if open_at is not None:
                raise ValueError(
                    f"{path}:{i + 1}: a region starts inside the one of line {open_at[0] + 1}"
                )
            flags = frozenset(match["flags"].split())
            if flags - FLAGS:
                raise ValueError(
                    f"{path}:{i + 1}: unknown flags {sorted(flags - FLAGS)}; "
                    f"allowed: {sorted(FLAGS)}"
                )
            open_at = (i, match["command"], flags)
        elif line.strip() == END:
            if open_at is None:
                raise ValueError(f"{path}:{i + 1}: {END} without a region")
            regions.append(Region(path, open_at[0], i, open_at[1], open_at[2]))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{path}:{open_at[0] + 1}: region has no {END}")
    return regions


def render(output: str, flags: Iterable[str]) -> list[str]:
    """The lines a region holds for a command's output."""
    lines = [line.rstrip() for line in output.rstrip("\n").splitlines()]
    return ["```", *lines, "```"] if "code" in flags else lines


class Runner:
    """Runs region commands (each distinct one once), from a cache when the
    sources have not changed."""

    def __init__(self, root: Path, cache: Path | None) -> None:
        self.root = root
        self.cache = cache
        self.outputs: dict[str, str] = {}
        self._digest: str | None = None

    def output(self, command: str) -> str:
        if command not in self.outputs:
            key = self._key(command)
            cached = self.cache / f"{key}.txt" if self.cache is not None else None
            if cached is not None and cached.exists():
                self.outputs[command] = cached.read_text()
            else:
                self.outputs[command] = self._run(command)
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_text(self.outputs[command])
        return self.outputs[command]

    def prefetch(self, commands: Iterable[str], jobs: int) -> None:
        """Run ``commands`` (each distinct one once) ``jobs`` at a time.  Each
        is a process of its own that spends most of its time importing torch,
        so on a machine of several cores they overlap well; their outputs are
        the same whichever order they run in."""
        pending = [c for c in dict.fromkeys(commands) if c not in self.outputs]
        self._sources()  # the digest every key shares, formed once before the threads
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for future in [pool.submit(self.output, c) for c in pending]:
                future.result()

    def _argv(self, command: str) -> list[str]:
        words = shlex.split(command)
        if not words or words[0] not in RUNNERS:
            raise ValueError(
                f"a generated command must start with {' or '.join(RUNNERS)}: {command!r}"
            )
        return RUNNERS[words[0]] + words[1:]

    def _run(self, command: str) -> str:
        argv = self._argv(command)
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        env["PYTHONPATH"] = os.pathsep.join(
            [*(str(self.root / p) for p in PATHS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        with tempfile.TemporaryDirectory(prefix="docs-check-") as scratch:
            for entry in self.root.iterdir():  # the tree's files, its runs/ left out
                if entry.name not in {"runs", ".git", ".cache"}:
                    (Path(scratch) / entry.name).symlink_to(entry)
            done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{command!r} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout

    def _key(self, command: str) -> str:
        named = [self.root / w for w in shlex.split(command) if (self.root / w).is_file()]
        digest = hashlib.sha256(command.encode())
        digest.update(self._sources().encode())
        for path in named:
            digest.update(path.read_bytes())
        for case in self._record_folders(command):
            for path in sorted(case.rglob("*.json")):
                digest.update(str(path.relative_to(self.root)).encode())
                digest.update(path.read_bytes())
        return digest.hexdigest()[:32]

    def _record_folders(self, command: str) -> list[Path]:
        """The records a command renders: those of each case it names, and every
        case's for ``kaisa bench summary`` (which reads every family's)."""
        records = self.root / RECORDS
        words = shlex.split(command)
        if words[:3] == ["kaisa", "bench", "summary"] and records.is_dir():
            return sorted(p for p in records.iterdir() if p.is_dir())
        return [
            records / w
            for w in dict.fromkeys(words)
            if w.strip(".") and "/" not in w and (records / w).is_dir()
        ]

    def _sources(self) -> str:
        if self._digest is None:
            digest = hashlib.sha256(importlib.metadata.version("torch").encode())
            digest.update(sys.version.encode())
            for top in SOURCES:
                for path in sorted((self.root / top).rglob("*.py")):
                    digest.update(str(path.relative_to(self.root)).encode())
                    digest.update(path.read_bytes())
            self._digest = digest.hexdigest()
        return self._digest


def doc_paths(root: Path, only: Sequence[str] = ()) -> list[Path]:
    paths = sorted({p for pattern in DOCS for p in root.glob(pattern)})
    if only:
        wanted = {(root / o).resolve() for o in only}
        paths = [p for p in paths if p.resolve() in wanted]
    return paths


def check_file(path: Path, runner: Runner, write: bool, slow: bool | None) -> list[str]:
    """The diffs of one markdown file's regions (rewritten in place with ``write``)."""
    while True:  # run the commands (minutes) first, then edit the file as it is now
        text = path.read_text()
        regions = [r for r in find_regions(path, text) if slow is None or r.slow == slow]
        for region in regions:
            runner.output(region.command)
        if path.read_text() == text:
            break
    lines = text.splitlines()
    diffs: list[str] = []
    # from the last region up, so rewriting one keeps the line numbers above it
    for region in reversed(regions):
        want = render(runner.output(region.command), region.flags)
        have = [line.rstrip() for line in lines[region.start + 1 : region.end]]
        if have != want:
            diffs.append(_diff(have, want, region.where(runner.root), region.command))
            lines[region.start + 1 : region.end] = want
    if write and diffs:
        path.write_text("\n".join(lines) + "\n")
    return diffs[::-1]


def check_files(runner: Runner, write: bool, slow: bool | None) -> list[str]:
    diffs = []
    for name, command in FILES.items():
        if slow is True:
            continue
        path = runner.root / name
        want = runner.output(command).rstrip("\n") + "\n"
        have = path.read_text() if path.exists() else ""
        if have != want:
            diffs.append(_diff(have.splitlines(), want.splitlines(), name, command))
            if write:
                path.write_text(want)
    return diffs


def _diff(have: list[str], want: list[str], where: str, command: str) -> str:
    body = difflib.unified_diff(
        have, want, f"{where} (committed)", f"{command} (prints)", lineterm=""
    )
    return "\n".join(body)


def _jobs(text: str) -> int:
    jobs = int(text)
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be a whole number >= 1; got {text!r}")
    return jobs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the regions that drifted")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--skip-slow", action="store_true", help="leave out regions marked slow")
    speed.add_argument("--only-slow", action="store_true", help="only the regions marked slow")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the repository (default: this one)"
    )
    parser.add_argument("--no-cache", action="store_true", help="run every command afresh")
    parser.add_argument(
        "--jobs",
        type=_jobs,
        default=min(os.cpu_count() or 1, MAX_JOBS),
        help=f"commands run at once (default: the machine's cores, at most {MAX_JOBS})",
    )
    parser.add_argument("files", nargs="*", help="only these markdown files (default: all)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    runner = Runner(root, None if args.no_cache else root / ".cache" / "docs-check")
    slow = False if args.skip_slow else True if args.only_slow else None
    paths = doc_paths(root, args.files)
    commands = [] if args.files or slow is True else list(FILES.values())
    for path in paths:
        commands += [r.command for r in find_regions(path) if slow is None or r.slow == slow]
    runner.prefetch(commands, args.jobs)
    diffs = [] if args.files else check_files(runner, args.write, slow)
    regions = 0
    for path in paths:
        regions += len(find_regions(path))
        diffs += check_file(path, runner, args.write, slow)
    for diff in diffs:
        print(diff, end="\n\n")
    verb = "rewrote" if args.write else "differ from their commands"
    if diffs:
        print(f"{len(diffs)} generated region(s) {verb}", file=sys.stderr)
        if not args.write:
            print("run `make docs-update` to regenerate them", file=sys.stderr)
        return 0 if args.write else 1
    print(
        f"{regions} generated region(s) and {len(FILES)} file(s) match their commands",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
