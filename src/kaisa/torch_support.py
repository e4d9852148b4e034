"""Which torch releases kaisa's features run on, and the error below them.

Eager K-FAC — the hooks' capture, every curvature method, the step, its
checkpoints — runs on torch 2.4 and newer (the unit suite passes there:
``make test-torch``; the distributed frameworks are tested on the pinned
torch only). Inside ``torch.compile`` kaisa leans on dynamo far harder: the
capture is traced into the model's graph (:mod:`kaisa.step.capture.graph`),
a factor position draw is folded into it (:mod:`kaisa.core.positions`) and
the stacked application is compiled whole
(:meth:`~kaisa.controls.StepControls.compile`). Older dynamo releases do not
fail cleanly there: under dynamic shapes 2.6 and 2.10 form factor statistics
that differ from the eager ones (2.10 where only a fraction of the positions
is read), with no error; 2.9 stops at the attention capture. So below
:data:`COMPILE_FLOOR` kaisa refuses a compiled model or
``precond.compile()`` with an error that names the floor, rather than train
on statistics it cannot vouch for; the same model run eagerly is unaffected.

A leaf module (torch only), so the capture and the step may both ask it.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "COMPILE_FLOOR",
    "COMPILE_SUPPORTED",
    "EAGER_FLOOR",
    "compile_refusal",
    "compile_supported",
    "release",
]

#: the oldest torch release (major, minor) kaisa runs on, eagerly: the unit
#: suite passes there (``make test-torch``'s default; pyproject's requirement)
EAGER_FLOOR: tuple[int, int] = (2, 4)

#: the oldest torch release (major, minor) whose ``torch.compile`` kaisa
#: supports: the whole unit suite, compiled tests included, passes there
COMPILE_FLOOR: tuple[int, int] = (2, 11)


def release(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch's);
    a nightly or local build counts as its release (``2.11.0a0+git…`` is 2.11)."""
    text = torch.__version__ if version is None else version
    found = re.match(r"(\d+)\.(\d+)", str(text))
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found.group(1)), int(found.group(2))


def compile_supported() -> bool:
    """Whether the installed torch is at or past :data:`COMPILE_FLOOR`."""
    return release() >= COMPILE_FLOOR


def compile_refusal(what: str) -> str:
    """The error for ``what`` (a compiled model, ``precond.compile()``) on a
    torch below :data:`COMPILE_FLOOR`."""
    floor, eager = (".".join(map(str, r)) for r in (COMPILE_FLOOR, EAGER_FLOOR))
    return (
        f"kaisa: {what} needs torch >= {floor} (installed: {torch.__version__}); "
        f"older releases' torch.compile cannot trace kaisa's capture faithfully. "
        f"Upgrade torch to {floor} or newer, or run the model without torch.compile "
        f"(eager K-FAC supports torch >= {eager})"
    )


#: :func:`compile_supported`, read once: code that dynamo traces asks this
#: constant (a regular expression there would break the graph)
COMPILE_SUPPORTED: bool = compile_supported()
