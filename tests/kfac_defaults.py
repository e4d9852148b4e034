"""Pinning KFACConfig's defaults for the tests written against kfac-pytorch's (see conftest)."""

from __future__ import annotations

import dataclasses

from kaisa.config import KFAC_PYTORCH_DEFAULTS, KFACConfig


def pin_defaults(values: dict[str, object]) -> dict[str, object]:
    """Make ``values`` KFACConfig's defaults (constructor and fields); return the old ones."""
    fields = dataclasses.fields(KFACConfig)
    init = KFACConfig.__init__
    defaults = list(init.__defaults__ or ())
    first = len(fields) - len(defaults)  # every field has a default
    old: dict[str, object] = {}
    for i, f in enumerate(fields):
        if f.name in values:
            old[f.name] = f.default
            f.default = values[f.name]
            defaults[i - first] = values[f.name]
    init.__defaults__ = tuple(defaults)
    return old


def pinned() -> dict[str, object]:
    """The current defaults of the options kfac-pytorch and kaisa disagree on."""
    return {
        f.name: f.default for f in dataclasses.fields(KFACConfig) if f.name in KFAC_PYTORCH_DEFAULTS
    }
