"""kfac-pytorch's own tests, run against kaisa with only the import switched.

Its ``tests/training_test.py``, ``tests/preconditioner_test.py`` and
``tests/scheduler_test.py`` are copied into a temporary folder at run time,
``from kfac.preconditioner import KFACPreconditioner`` becomes
``from kaisa import KFACPreconditioner``, and pytest runs them (everything
else — ``kfac.enums``, ``kfac.scheduler.LambdaParamScheduler``, its
``testing`` helpers — stays kfac-pytorch's).

Two runs:

* **only the import switched**: every test passes except those in
  :data:`DIFFERENCES`, and each of those fails exactly at its documented
  statement (docs/kfac-pytorch.md);
* **with each documented statement replaced** by kaisa's behaviour: every
  test passes, so the checks after a documented difference run too.
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kfac_pytorch_source import PYTHON, kfac_pytorch_env, require_kfac_pytorch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FILES = ("training_test.py", "preconditioner_test.py", "scheduler_test.py")
IMPORT = "from kfac.preconditioner import KFACPreconditioner\n"

#: (file, test, kfac-pytorch's statement, kaisa's, the reason) — each also in docs/kfac-pytorch.md
DIFFERENCES = (
    (
        "preconditioner_test.py",
        "test_preconditioner_init_raises",
        """    with pytest.raises(ValueError):
        KFACPreconditioner(
            TinyModel(),
            compute_eigenvalue_outer_product=True,
            compute_method=ComputeMethod.EIGEN,
            colocate_factors=False,
        )
""",
        """    KFACPreconditioner(
        TinyModel(),
        compute_eigenvalue_outer_product=True,
        compute_method=ComputeMethod.EIGEN,
        colocate_factors=False,
    )
""",
        "kaisa supports the eigenvalue outer product without colocated factors: "
        "the gradient worker forms it once both eigendecompositions arrive",
    ),
    (
        "preconditioner_test.py",
        "test_preconditioner_logging",
        "    assert sum('KAISAAssignment' in msg for msg in messages) == 1\n",
        "    assert sum('KFAC layer assignments: WorkPlan' in msg for msg in messages) == 1\n",
        "kaisa's assignment is a WorkPlan, logged once under kfac-pytorch's "
        "'KFAC layer assignments:' prefix; kfac-pytorch logs its KAISAAssignment class",
    ),
)


def _copy(source: Path, dest: Path, documented: bool) -> None:
    dest.mkdir(parents=True)
    for name in FILES:
        text = (source / "tests" / name).read_text()
        assert text.count(IMPORT) == 1, f"{name}: kfac-pytorch's import line changed"
        text = text.replace(IMPORT, "from kaisa import KFACPreconditioner\n")
        if documented:
            for file, _, theirs, ours, _ in DIFFERENCES:
                if file == name:
                    assert text.count(theirs) == 1, f"{name}: documented statement not found"
                    text = text.replace(theirs, ours)
        (dest / name).write_text(text)


def _outcomes(report: Path) -> dict[str, str]:
    """``{'dir/file.py::test': 'passed' | failure text}`` from a JUnit report."""
    out: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        failed = [c for c in case if c.tag in ("failure", "error")]
        skipped = [c for c in case if c.tag == "skipped"]
        if failed:
            out[key] = (failed[0].get("message") or "") + (failed[0].text or "")
        else:
            out[key] = "skipped" if skipped else "passed"
    return out


def test_kfac_pytorch_tests_pass_with_only_the_import_switched(tmp_path: Path) -> None:
    source = require_kfac_pytorch()
    _copy(source, tmp_path / "switched", documented=False)
    _copy(source, tmp_path / "documented", documented=True)
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            PYTHON,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "--rootdir",
            str(tmp_path),
            "-o",
            "addopts=",
            "-o",
            "timeout=240",
            f"--junitxml={report}",
            "switched",
            "documented",
        ],
        cwd=tmp_path,
        env=kfac_pytorch_env(source, tmp_path, tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert report.exists(), run.stdout[-4000:] + run.stderr[-4000:]
    outcomes = _outcomes(report)
    differing = {test for _, test, *_ in DIFFERENCES}
    ran = {key.rsplit("::", 1)[1].split("[", 1)[0] for key in outcomes}
    assert {"test_training", "test_scheduler", "test_input_check"} <= ran, sorted(ran)
    assert differing <= ran
    for key, outcome in outcomes.items():
        folder, test = key.split(".", 1)[0], key.rsplit("::", 1)[1].split("[", 1)[0]
        if folder == "switched" and test in differing:
            # fails, and at its documented statement: "<file>:<its line>: " in the traceback
            file, _, statement, *_ = next(d for d in DIFFERENCES if d[1] == test)
            text = (tmp_path / "switched" / file).read_text()
            line = text[: text.index(statement)].count("\n") + 1
            assert outcome != "passed", (
                f"{key} passes: drop it from DIFFERENCES and docs/kfac-pytorch.md"
            )
            assert f"{file}:{line}: " in outcome, (key, line, outcome[-2000:])
        else:
            assert outcome == "passed", f"{key}: {outcome[-3000:]}\n{run.stdout[-3000:]}"
