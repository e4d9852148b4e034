"""A type checker sees the constructor's options (issue 22, item 5).

``KFACPreconditioner`` lists every option with its type, so mypy reports a
misspelt option and a wrongly typed one where a script makes the call, and
accepts every spelling the constructor takes at run time (names, another
library's enum members, dtype names, callables of the step).  The snippets are
checked against the kaisa that is imported (this checkout's sources).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import kaisa

mypy_api = pytest.importorskip("mypy.api")

HEADER = """
from enum import Enum

import torch

from kaisa import KFACPreconditioner


class ComputeMethod(Enum):  # kfac-pytorch's enums are plain Enums, matched by name
    EIGEN = 1


model = torch.nn.Linear(4, 4)
"""

GOOD = """
KFACPreconditioner(
    model,
    factor_update_steps=lambda step: 10 if step < 100 else 50,
    damping=0.01,
    kl_clip=None,
    compute_method="eigen",
    grad_worker_fraction=0.5,
    factor_dtype="float64",
    inv_dtype=torch.float64,
    skip_layers=["head", "embed"],
    memory_budget_mb=512,
)
KFACPreconditioner(model, compute_method=ComputeMethod.EIGEN, grad_worker_fraction="mem-opt")
"""

BAD = {
    "KFACPreconditioner(model, dampning=0.01)": r'Unexpected keyword argument "dampning"',
    'KFACPreconditioner(model, damping="x")': r'Argument "damping" .* incompatible type "str"',
    'KFACPreconditioner(model, colocate_factors="no")': r'Argument "colocate_factors"',
}

# torch and numpy are left unanalysed (Any): the test is about kaisa's signature,
# and reading torch's sources would take most of a minute
CONFIG = """
[mypy]
python_version = 3.11
follow_imports = silent
ignore_missing_imports = true
mypy_path = {src}

[mypy-torch.*,numpy.*]
follow_imports = skip
"""


def _mypy(tmp_path: Path, body: str) -> list[str]:
    """mypy's error lines for ``HEADER + body``, as ``<line>: <message>``."""
    src = Path(kaisa.__file__).resolve().parents[1]
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG.format(src=src))
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(HEADER) + textwrap.dedent(body))
    stdout, stderr, _ = mypy_api.run(
        [
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            "--hide-error-context",
            str(script),
        ]
    )
    assert not stderr, stderr
    return [
        re.sub(r"^.*script\.py:", "", line)
        for line in stdout.splitlines()
        if "script.py" in line and ": error:" in line
    ]


def test_mypy_reports_a_misspelt_and_a_wrongly_typed_option(tmp_path: Path) -> None:
    assert _mypy(tmp_path, GOOD) == []
    first = len(textwrap.dedent(HEADER).splitlines()) + 1
    errors = _mypy(tmp_path, "\n".join(BAD))
    for line, (call, message) in enumerate(BAD.items(), start=first):
        mine = [e for e in errors if e.startswith(f"{line}:")]
        assert any(re.search(message, e) for e in mine), (call, errors)
