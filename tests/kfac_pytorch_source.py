"""Where kfac-pytorch's source lies, and an environment that imports it.

kfac-pytorch is not on the package registry; a copy of its source (MIT, at
869cf11) lies in ``shared/kfac-pytorch`` beside this repository (the
project's checkout and CI's clone both have ``../shared``).  Tests import it
from there and never copy it into the project; a test that needs it skips,
with the reason, only where that folder is absent.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kfac_pytorch_dir() -> Path | None:
    """``KAISA_KFAC_PYTORCH`` if set, else the nearest ``shared/kfac-pytorch``
    above this repository."""
    given = os.environ.get("KAISA_KFAC_PYTORCH")
    if given:
        return Path(given) if (Path(given) / "kfac").is_dir() else None
    for parent in ROOT.parents:
        candidate = parent / "shared" / "kfac-pytorch"
        if (candidate / "kfac").is_dir():
            return candidate
    return None


def require_kfac_pytorch() -> Path:
    found = kfac_pytorch_dir()
    if found is None:
        pytest.skip(
            "kfac-pytorch's source is absent (expected in ../shared/kfac-pytorch or "
            "$KAISA_KFAC_PYTORCH); it is not on the package registry"
        )
    return found


def kfac_pytorch_env(source: Path, tmp: Path, *first: Path) -> dict[str, str]:
    """The environment of a subprocess that imports ``kfac`` from ``source``.

    A source tree that was never pip-installed has no package metadata, which
    its ``kfac/__init__.py`` reads for ``__version__``: a minimal
    ``dist-info`` in ``tmp`` gives it one.  ``first`` go before it on the path.
    """
    meta = tmp / "kfac-pytorch-metadata"
    info = meta / "kfac_pytorch-0.4.2.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kfac-pytorch\nVersion: 0.4.2\n")
    path = [*map(str, first), str(meta), str(source), str(ROOT / "src")]
    old = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path + ([old] if old else [])),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore::DeprecationWarning",
    }


PYTHON = sys.executable


def import_kfac(tmp: Path) -> object:
    """Import kfac-pytorch's ``kfac`` package into this process (skips where
    its source is absent); ``tmp`` holds the metadata it reads."""
    source = require_kfac_pytorch()
    env = kfac_pytorch_env(source, tmp)
    for entry in reversed(env["PYTHONPATH"].split(os.pathsep)[:2]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import importlib

    importlib.invalidate_caches()
    return importlib.import_module("kfac")
