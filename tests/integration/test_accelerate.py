"""The accelerate recipe (``precond.step()`` when ``accelerator.sync_gradients``)
gives the parameters of the plain torch loop with kaisa, with accumulation."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")
from framework_case import (  # noqa: E402
    accelerate_recipe,
    assert_close,
    micro_batches,
    plain_loop,
)


def test_accelerate_recipe_equals_plain_loop() -> None:
    assert_close(accelerate_recipe(accelerate, micro_batches()), plain_loop())
