"""Fixtures shared by the unit tests."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def float64_default() -> Iterator[None]:
    """float64 as the default dtype, for the dense-reference comparisons."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
