"""Warnings that name the user's line.

A warning raised deep in kaisa (a hook run by autograd, a step called
through DDP, Lightning or a compiled region) is only useful if it points at
the user's code, not at the frame that happened to raise it; a hard-coded
``stacklevel`` is right for one call path and wrong for the others. So the
level is found by walking the stack past kaisa's and torch's own frames.
A leaf module (the standard library only), so any part of kaisa may use it.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

__all__ = ["warn_user"]

_KAISA = str(Path(__file__).resolve().parent) + "/"


def _library_roots() -> tuple[str, ...]:
    roots = [_KAISA]
    location = getattr(sys.modules.get("torch"), "__file__", None)
    if location:
        roots.append(str(Path(location).resolve().parent) + "/")
    return tuple(roots)


@functools.lru_cache(maxsize=512)
def _inside(filename: str, roots: tuple[str, ...]) -> bool:
    return str(Path(filename).resolve()).startswith(roots)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside kaisa and torch."""
    roots = _library_roots()
    level, frame = 2, sys._getframe(1)  # stacklevel 2: warn_user's caller
    while frame is not None and _inside(frame.f_code.co_filename, roots):
        if frame.f_back is None:
            break  # nothing outside the libraries (a hook called from C++): keep the last
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
