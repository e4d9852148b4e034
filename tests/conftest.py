"""Suite-wide settings.

torch runs one thread in the test process: the distributed tests fork worker
processes, and a forked child deadlocks if the parent has already started a
multi-threaded OpenMP pool (see FIELD-NOTES).  It also makes float results
independent of the thread count.
"""

import torch

torch.set_num_threads(1)


# -- library defaults ----------------------------------------------------------------
# The suite was written when kaisa's defaults were kfac-pytorch's (eigen, factors
# and decompositions every step, damping 0.001).  Tests that build a
# preconditioner without naming those options rely on them, so they run with
# kaisa.KFAC_PYTORCH_DEFAULTS pinned as the defaults: the meaning of every
# existing test is unchanged.  Tests of kaisa's own defaults are marked
# ``library_defaults`` and see them untouched.  Forked ranks inherit the pin;
# tests/distributed/harness.py re-applies it in forkserver ranks.
import pytest  # noqa: E402

from kaisa.config import KFAC_PYTORCH_DEFAULTS  # noqa: E402
from kfac_defaults import pin_defaults  # noqa: E402

# Pinned at import, so fixtures of every scope (module-scoped runs included) see it.
LIBRARY_DEFAULTS = pin_defaults(dict(KFAC_PYTORCH_DEFAULTS))


@pytest.fixture(autouse=True)
def kfac_pytorch_defaults(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Un-pin for the tests marked ``library_defaults``, for their duration."""
    if not request.node.get_closest_marker("library_defaults"):
        yield
        return
    pinned = pin_defaults(LIBRARY_DEFAULTS)
    try:
        yield
    finally:
        pin_defaults(pinned)
