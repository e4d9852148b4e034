"""kfac-pytorch's values of the options where kaisa's defaults differ, for
the tests written against them.

The suite runs on kaisa's shipped defaults; a test that means kfac-pytorch's
(eigen method, factors and decompositions every step, damping 0.001) says so
by passing them through :func:`kfac_pytorch`, with its own options on top.
"""

from __future__ import annotations

from kaisa.config import KFAC_PYTORCH_DEFAULTS


def kfac_pytorch(**overrides: object) -> dict[str, object]:
    """kfac-pytorch's values (:data:`kaisa.KFAC_PYTORCH_DEFAULTS`), with ``overrides``."""
    return {**KFAC_PYTORCH_DEFAULTS, **overrides}
