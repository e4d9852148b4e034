"""kaisa.tune_cpu_allocator: freed memory stays in the process (glibc, Linux).

Checked in a fresh interpreter each time (the thresholds are process-wide): a
step that allocates and frees 48 MiB of tensors, a little larger each step,
is mapped and unmapped by glibc each time, so every page is faulted in again;
with the thresholds raised the heap keeps them and the step faults a few
pages at most.  (Steps of identical sizes are served from the heap by default
or not, depending on what else lies there — in the suite it varied with the
thread-count variables — so the probe does not rely on them.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kaisa

PROBE = """
import resource, sys, torch
import kaisa
if sys.argv[1] == "tuned":
    assert kaisa.tune_cpu_allocator()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def step(k):
    # 3 x 16 MiB (+ one page more each step, as activations of a growing
    # batch or sequence would): by default each is above the mmap threshold
    # the last free set, so it is mapped, faulted in and unmapped every step
    held = [torch.ones((4 << 20) + 1024 * k) for _ in range(3)]
    del held

for k in range(3):
    step(k)
before = faults()
for k in range(3, 13):
    step(k)
print((faults() - before) / 10)
"""


def faults_per_step(mode: str) -> float:
    # the suite's thread-count variables stay out of the probe (they change
    # what else lies on the heap)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.needs_torch(
    (2, 10), "under torch 2.4 the tuned probe's faults vary from run to run, often in the 1000s"
)
def test_raised_thresholds_stop_the_page_faults_of_freed_tensors() -> None:
    default, tuned = faults_per_step("default"), faults_per_step("tuned")
    assert default > 3 * 4096 / 2  # at least half of the step's 3 x 4096 pages, every step
    assert tuned < default / 100


def test_unsupported_platform_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert kaisa.tune_cpu_allocator() is False
