"""``pip install kaisa`` is the preconditioner alone (issue 22): its wheel holds
no experiment harness, needs only torch, numpy and tqdm, and importing it
pulls in neither the harness (kaisa-lab, ``lab/``) nor its dependencies."""

from __future__ import annotations

import ast
import email.parser
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
#: what the root distribution builds from (pyproject's readme and packages)
BUILD_INPUTS = ("pyproject.toml", "README.md", "src")
#: the harness's modules, which must not ship in (or be imported by) the library
HARNESS = ("kaisa/cli/", "kaisa/tasks/", "kaisa/zoo/", "kaisa_lab")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kaisa's wheel, built offline from a copy of its build inputs (the tree
    itself stays free of build/ and egg-info)."""
    tree = tmp_path_factory.mktemp("tree")
    for name in BUILD_INPUTS:
        source = ROOT / name
        if source.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
            shutil.copytree(source, tree / name, ignore=ignore)
        else:
            shutil.copy2(source, tree / name)
    out = tmp_path_factory.mktemp("wheel")
    argv = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*argv, "--no-index", "-w", str(out)], cwd=tree, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (built,) = out.glob("kaisa-*.whl")
    return built


def test_the_wheel_holds_the_library_alone(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "kaisa/__init__.py" in names and "kaisa/py.typed" in names
    shipped = [n for n in names if any(part in n for part in HARNESS)]
    assert shipped == [], f"the harness ships in kaisa's wheel: {shipped[:5]}"
    entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points == [], "the kaisa command belongs to kaisa-lab"


def test_the_wheel_requires_torch_numpy_and_tqdm_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    requires = message.get_all("Requires-Dist") or []
    parsed = [Requirement(r) for r in requires]
    plain = {r.name.lower() for r in parsed if r.marker is None or "extra" not in str(r.marker)}
    assert plain == {"torch", "numpy", "tqdm"}, requires
    extras = set(message.get_all("Provides-Extra") or [])
    assert "tasks" not in extras, "scikit-learn/matplotlib come with kaisa-lab"


def test_importing_kaisa_imports_no_harness_sklearn_or_matplotlib() -> None:
    probe = (
        "import json, sys, kaisa; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(json.loads(done.stdout))
    assert "kaisa" in loaded
    assert not loaded & {"kaisa_lab", "sklearn", "matplotlib"}, loaded


def test_importing_kaisa_leaves_the_compiler_unloaded() -> None:
    """``import torch`` does not load dynamo, and neither may ``import kaisa``:
    dynamo takes about 1.5 s to import, paid by every rank a job spawns and
    every command-line call.  Nothing in kaisa may mark a function for the
    compiler at import (``torch.compiler.disable`` and the like load it)."""
    probe = "import sys, kaisa; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def test_the_library_imports_the_harness_only_in_its_main_module() -> None:
    """``python -m kaisa`` hands over to kaisa-lab's command; no other module
    of src/kaisa may import kaisa_lab (nor the harness's old homes)."""
    found = []
    for path in sorted((ROOT / "src" / "kaisa").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                harness = name.split(".")[0] == "kaisa_lab" or re.match(
                    r"kaisa\.(cli|tasks|zoo)\b", name
                )
                if harness and path.name != "__main__.py":
                    found.append(f"{path.relative_to(ROOT)}: {name}")
    assert found == []


#: ``python -m kaisa --help`` with kaisa_lab made unimportable
WITHOUT_LAB = """
import importlib.abc, runpy, sys

class NoLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kaisa_lab":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoLab())
sys.argv = ["kaisa", "--help"]
runpy.run_module("kaisa", run_name="__main__", alter_sys=True)
"""


def test_python_m_kaisa_without_the_lab_says_to_install_it() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_LAB], capture_output=True, text=True)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "kaisa-lab" in done.stderr and "pip install" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
