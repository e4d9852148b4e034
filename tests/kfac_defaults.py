"""Pinning kaisa's defaults for the tests written against kfac-pytorch's (see conftest).

A default lives in three places once the constructor lists its options: the
field of the per-concern config that declares it, the flat ``KFACConfig``'s
generated ``__init__``, and ``KFACPreconditioner.__init__``'s signature.
``pin_defaults`` patches all three, so every way of building a preconditioner
or a config sees the pinned value.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from kaisa.config import CONCERNS, KFAC_PYTORCH_DEFAULTS, KFACConfig
from kaisa.preconditioner import KFACPreconditioner

#: every function whose keyword defaults are options
_SIGNATURES: tuple[Callable[..., Any], ...] = (inspect.unwrap(KFACPreconditioner.__init__),)


class Defaults(dict[str, object]):
    """The defaults a pin replaced, by option (the configs'), and each
    signature's own: restoring them restores a signature that drifted from the
    configs as it was, so the tests of kaisa's defaults see the drift."""

    signatures: list[dict[str, object]]


def _patch_kwdefaults(function: Any, values: dict[str, object]) -> dict[str, object]:
    """Set the keyword defaults named in ``values``; return what they were."""
    defaults = dict(function.__kwdefaults__ or {})
    old = {k: defaults[k] for k in values if k in defaults}
    defaults.update({k: v for k, v in values.items() if k in defaults})
    function.__kwdefaults__ = defaults
    return old


def pin_defaults(values: dict[str, object]) -> Defaults:
    """Make ``values`` the defaults of the configs and of the constructor; return the old ones."""
    by_name = {f.name: f for f in dataclasses.fields(KFACConfig)}
    old = Defaults({name: by_name[name].default for name in values})
    for name, value in values.items():
        by_name[name].default = value  # the one Field object every config shares
        for cls in (*CONCERNS, KFACConfig):
            if name in vars(cls):  # the class attribute dataclass sets to the default
                setattr(cls, name, value)
    for cls in (*CONCERNS, KFACConfig):
        _patch_kwdefaults(cls.__init__, values)
    own = values.signatures if isinstance(values, Defaults) else [values] * len(_SIGNATURES)
    old.signatures = [_patch_kwdefaults(f, v) for f, v in zip(_SIGNATURES, own, strict=True)]
    return old


def kfac_pytorch(**overrides: object) -> dict[str, object]:
    """kfac-pytorch's values of the options where kaisa's defaults differ,
    with ``overrides``: what a test meant for kfac-pytorch's defaults passes
    explicitly once its module runs on kaisa's shipped defaults (marked
    ``library_defaults``, the way every module goes before the pin is dropped)."""
    return {**KFAC_PYTORCH_DEFAULTS, **overrides}


def pinned() -> dict[str, object]:
    """The current defaults of the options kfac-pytorch and kaisa disagree on."""
    return {
        f.name: f.default for f in dataclasses.fields(KFACConfig) if f.name in KFAC_PYTORCH_DEFAULTS
    }
