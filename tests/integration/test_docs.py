"""The docs' generated regions equal what their commands print (tools/docs_check.py),
and the documentation site builds with no warning (mkdocs.yml, ``make docs``).

The quick regions run in the fast suite, the slow ones (commands that take
more than a few seconds) under ``slow``,
so ``make test`` checks every region; outputs
are cached by a digest of the sources, so a re-run without a change is quick.
A region whose numbers were edited by hand, or whose command now prints
something else, fails with a diff; ``make docs-update`` rewrites them.

The site (README.md as its landing page, the guides under ``docs/``, the API
reference from the public objects' docstrings) is built with ``--strict``:
a broken link or anchor, an unresolved cross-reference or a docstring that
griffe cannot read fails the suite.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_check", ROOT / "tools" / "docs_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_check"] = module
    spec.loader.exec_module(module)
    return module


docs_check = load_tool()


def check(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = docs_check.main(list(args))
    return code, out.getvalue()


# every quick region's command runs afresh on a clean clone (the cache is
# empty), each in a process of its own, as many at once as there are cores:
# 4.5 min on a 2-core machine whose cores two campaign workers keep busy
@pytest.mark.timeout(600)
def test_the_quick_regions_match_their_commands() -> None:
    code, diff = check("--skip-slow")
    assert code == 0, f"docs drifted from their commands (make docs-update):\n{diff}"


@pytest.mark.slow
# every slow region's command runs afresh on a clean clone (the cache is
# empty): 2.5 min on a quiet 2-core machine, past 5 on a loaded one
@pytest.mark.timeout(1200)
def test_the_slow_regions_match_their_commands() -> None:
    code, diff = check("--only-slow")
    assert code == 0, f"docs drifted from their commands (make docs-update):\n{diff}"


#: the first line of every table a command prints: a plan, the plan-paper
#: case's tables, the bytes and memory tables of the strategies and
#: tensor-parallel-comm cases, the precision case's memory table and the
#: compile-step case's graph counts
GENERATED_TABLE = re.compile(
    r"^(\s+W\s+fraction workers|\| W \| (MiB|ms) 1/W|\| f \| capture"
    r"|\| grad_worker_fraction \| workers/layer \| K-FAC bytes"
    r"|\| dp × tp \| model \| configuration \| tp bytes"
    r"|\| model \| products in \| second-order bytes"
    r"|\| model \| graphs/forward plain \| with kaisa)"
)


def test_every_plan_and_bytes_table_in_the_docs_is_generated() -> None:
    """A ``kaisa plan`` table, a table of the plan-paper case or a benchmark's
    bytes or memory table pasted by hand would not be checked: each must
    sit inside a region."""
    for path in docs_check.doc_paths(ROOT):
        lines = path.read_text().splitlines()
        inside = set()
        for region in docs_check.find_regions(path):
            inside.update(range(region.start, region.end))
        for i, line in enumerate(lines):
            if GENERATED_TABLE.match(line):
                assert i in inside, (
                    f"{path.name}:{i + 1} is a generated table outside a generated region"
                )
    regions = [r for p in docs_check.doc_paths(ROOT) for r in docs_check.find_regions(p)]
    planning = docs_check.find_regions(ROOT / "docs" / "planning.md")
    assert any("kaisa plan" in r.command for r in planning)  # the README's moved there
    cases = ("plan-paper", "strategies", "tensor-parallel-comm", "precision", "compile-step")
    for name in cases:  # docs/planning.md, docs/benchmarks.md: from the committed records
        assert any(f"kaisa bench report {name} --table" in r.command for r in regions), name


def small_tree(tmp_path: Path, body: str) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(body)
    return tmp_path


COMMAND = "python -c \"print('| W | MiB |'); print('| 64 | 668.9 |   ')\""


def test_a_number_edited_by_hand_fails_with_a_diff_and_write_restores_it(tmp_path: Path) -> None:
    region = f"<!-- generated: {COMMAND} -->\n| W | MiB |\n| 64 | 668.9 |\n<!-- end generated -->\n"
    root = small_tree(tmp_path, f"# doc\n\n{region}\ntext after\n")
    files = ["--root", str(root), "--no-cache", "README.md"]
    assert check(*files) == (0, "")  # trailing spaces of the output do not count
    edited = region.replace("| 64 | 668.9 |\n", "| 64 | 695.9 |\n")
    (root / "README.md").write_text(f"# doc\n\n{edited}\ntext after\n")
    code, diff = check(*files)
    assert code == 1 and "-| 64 | 695.9 |" in diff and "+| 64 | 668.9 |" in diff
    assert check("--write", *files)[0] == 0
    assert (root / "README.md").read_text() == f"# doc\n\n{region}\ntext after\n"


def test_code_regions_are_fenced_and_bad_regions_refused(tmp_path: Path) -> None:
    region = (
        "<!-- generated code: python -c \"print('a')\" -->\n```\nb\n```\n<!-- end generated -->\n"
    )
    root = small_tree(tmp_path, region)
    files = ["--root", str(root), "--no-cache", "README.md"]
    code, diff = check(*files)
    assert code == 1 and "-b" in diff and "+a" in diff
    (root / "README.md").write_text("<!-- generated: rm -rf / -->\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="must start with kaisa or python"):
        check(*files)
    (root / "README.md").write_text("<!-- generated: python -c 'print(1)' -->\n")
    with pytest.raises(ValueError, match="no <!-- end generated -->"):
        check(*files)
    (root / "README.md").write_text("<!-- generated fast: python -c 'print(1)' -->\n")
    with pytest.raises(ValueError, match="unknown flags"):
        check(*files)


def _meets(me: Path, other: Path) -> str:
    """A command that marks ``me``, then waits (20 s at most) for ``other``'s
    mark: both print ``met`` only where they run at the same time."""
    wait = (
        f"import pathlib, time; pathlib.Path({str(me)!r}).touch(); o = pathlib.Path({str(other)!r}); "
        "t = time.time() + 20; "
        "[time.sleep(0.05) for _ in iter(lambda: o.exists() or time.time() > t, True)]; "
        "print('met' if o.exists() else 'alone')"
    )
    return f"python -c {shlex.quote(wait)}"


def test_the_commands_run_side_by_side_and_each_once(tmp_path: Path) -> None:
    """``--jobs``: the distinct commands run that many at a time (two commands
    that each wait for the other meet), and a region's command another region
    shares runs once."""
    one, two = _meets(tmp_path / "a", tmp_path / "b"), _meets(tmp_path / "b", tmp_path / "a")
    regions = "".join(
        f"<!-- generated: {c} -->\nmet\n<!-- end generated -->\n" for c in (one, two, one)
    )
    (tmp_path / "tree").mkdir()
    root = small_tree(tmp_path / "tree", regions)
    runner = docs_check.Runner(root, None)
    ran: list[str] = []
    run = runner._run
    runner._run = lambda command: ran.append(command) or run(command)  # type: ignore[method-assign]
    runner.prefetch([r.command for r in docs_check.find_regions(root / "README.md")], jobs=2)
    assert sorted(ran) == sorted([one, two])
    assert docs_check.check_file(root / "README.md", runner, write=False, slow=None) == []
    assert len(ran) == 2


def test_jobs_below_one_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        check("--jobs", "0")
    assert "--jobs must be a whole number >= 1; got '0'" in capsys.readouterr().err


def test_regions_in_a_folder_under_docs_are_checked(tmp_path: Path) -> None:
    """The guides may live in folders (docs/api/…): their regions are checked too."""
    root = small_tree(tmp_path, "# doc\n")
    (root / "docs" / "guide").mkdir()
    page = root / "docs" / "guide" / "page.md"
    page.write_text("<!-- generated: python -c \"print('a')\" -->\nb\n<!-- end generated -->\n")
    assert page in docs_check.doc_paths(root)
    code, diff = check("--root", str(root), "--no-cache", "docs/guide/page.md")
    assert code == 1 and "docs/guide/page.md:1" in diff and "+a" in diff


# -- the documentation site -------------------------------------------------------------

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (the dev extra installs it: pip install -e '.[dev]')",
)


def build_site(root: Path, site: Path) -> tuple[int, str]:
    """``mkdocs build --strict`` of the tree at ``root`` into ``site``: exit code and log."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done.returncode, done.stdout + done.stderr


@needs_mkdocs
def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    code, log = build_site(ROOT, tmp_path / "site")
    assert code == 0 and "WARNING" not in log, f"make docs fails:\n{log}"
    landing = (tmp_path / "site" / "index.html").read_text()
    assert "Two lines in your training script" in landing  # README.md is the landing page
    assert 'href="getting-started/"' in landing  # its docs/… links point into the site
    api = (tmp_path / "site" / "api" / "preconditioner" / "index.html").read_text()
    assert "Precondition the gradients of every registered layer in place." in api
    assert ":class:" not in api and ":meth:" not in api  # reST roles rendered as code


def site_copy(tmp_path: Path) -> Path:
    """What the site is built from (mkdocs.yml, README.md, docs/, tools/, src/), copied."""
    root = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("docs", "tools", "src"):
        shutil.copytree(ROOT / name, root / name, ignore=ignore)
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    return root


@needs_mkdocs
def test_a_broken_link_reference_or_docstring_fails_the_build(tmp_path: Path) -> None:
    """Each defect is reported as a warning, and a warning fails the build."""
    root = site_copy(tmp_path)
    page = root / "docs" / "numerics.md"
    page.write_text(
        page.read_text()
        + "\n[gone](no-such-page.md), [no section](engines.md#no-such-section), "
        + "[kaisa.NoSuchObject][]\n"
    )
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/no-such-guide.md)\n")
    scheduler = root / "src" / "kaisa" / "scheduler.py"
    text = scheduler.read_text()
    documented = "        lr_lambda: the same for the learning rate the KL clip assumes.\n"
    assert documented in text
    scheduler.write_text(text.replace(documented, documented + "        no_such_lambda: gone.\n"))
    code, log = build_site(root, tmp_path / "site")
    assert code != 0 and "Aborted with" in log, log
    warnings = "\n".join(line for line in log.splitlines() if line.startswith("WARNING"))
    for warning in (
        "'no-such-page.md'",  # a link to a missing page
        "'engines.md#no-such-section'",  # an anchor that is not there
        "'no-such-guide.md'",  # the README's link, as the landing page holds it
        "kaisa.NoSuchObject",  # a cross-reference to no object
        "no_such_lambda",  # a docstring parameter the signature lacks
    ):
        assert warning in warnings, f"{warning} not reported as a warning:\n{log}"


def test_a_cached_output_is_stale_once_a_record_it_renders_changes(tmp_path: Path) -> None:
    """A report's cache key covers the records of the case it names; the
    summary's, every case's records (it reads every family's)."""
    records = tmp_path / "benchmarks" / "records"
    for case in ("text-lm", "text-cnn"):
        (records / case / "adamw").mkdir(parents=True)
        (records / case / "adamw" / "r-s5.json").write_text("{}\n")
    runner = docs_check.Runner(tmp_path, None)
    commands = ["kaisa bench summary", "kaisa bench report text-lm --table heldout"]
    before = {c: runner._key(c) for c in commands}
    (records / "text-cnn" / "adamw" / "r-s6.json").write_text("{}\n")
    after = {c: docs_check.Runner(tmp_path, None)._key(c) for c in commands}
    assert after["kaisa bench summary"] != before["kaisa bench summary"]
    assert after[commands[1]] == before[commands[1]]  # text-cnn's records are not text-lm's
    (records / "text-lm" / "adamw" / "r-s6.json").write_text("{}\n")
    assert docs_check.Runner(tmp_path, None)._key(commands[1]) != before[commands[1]]
