"""Keep freed memory in the process on CPU (glibc), so steps stop faulting pages in.

PyTorch's CPU tensors come from the C allocator.  glibc serves a large
allocation with ``mmap`` and gives it back on ``free`` (its threshold adapts
upwards as it goes), and trims the top of its heap whenever more than a
threshold is free there.  A training step frees and reallocates the same
large temporaries every time, so every page of them is faulted in again,
every step: thousands of page faults per step on a small CNN, and a step
time that wanders from one run to the next with them.  With both thresholds
raised the faults all but vanish and the step time holds still, for SGD and
K-FAC alike (the step-cost case counts the faults per step:
``kaisa bench run step-cost --option allocator=default``,
``docs/reports/step-cost.md``).

Raising the thresholds means memory freed by one step stays with the process
for the next (its peak is reached every step anyway).  It changes the whole
process, so the library never does it on its own: the ``kaisa`` command and
the benchmarks call :func:`tune_cpu_allocator` (``--default-allocator`` to
opt out), and a training script may call it once at start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["tune_cpu_allocator"]

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: glibc refuses an mmap threshold above half its largest heap (32 MiB on 64-bit)
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def tune_cpu_allocator(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Serve allocations up to ``mmap_threshold`` bytes from glibc's heap and
    trim the heap only beyond ``trim_threshold`` free bytes.

    Returns whether glibc accepted both (False off Linux/glibc, e.g. macOS
    or musl, where nothing is changed).  Both must be set: fixing the trim
    threshold alone also freezes the mmap threshold at its 128 KiB start,
    and then every large tensor is an ``mmap`` (measured: 68,000 faults per
    step instead of 23,000).

    Measured from torch 2.10 on; under torch 2.4 the same probe
    (``tests/unit/test_allocator.py``) still faults in most steps, by an
    amount that varies from run to run (its cause is not known).
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    return mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1 and ok
