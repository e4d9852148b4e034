"""Suite-wide settings.

torch runs one thread in the test process: the distributed tests fork worker
processes, and a forked child deadlocks if the parent has already started a
multi-threaded OpenMP pool (see FIELD-NOTES).  It also makes float results
independent of the thread count.

A test of a feature that needs a newer torch than the oldest kaisa supports
carries ``@pytest.mark.needs_torch((major, minor), why)``: on an older torch
(``make test-torch``) it skips, saying which release and why; on the pinned
torch every such test runs.
"""

from typing import Any

import pytest
import torch

from kaisa.torch_support import release

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    installed = release()
    for item in items:
        for mark in item.iter_markers("needs_torch"):
            needed, why = mark.args
            if installed < tuple(needed):
                floor = ".".join(map(str, needed))
                reason = f"needs torch >= {floor} ({why}); installed: {torch.__version__}"
                item.add_marker(pytest.mark.skip(reason=reason))
