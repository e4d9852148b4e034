"""``kaisa`` in-process, printing every evaluation the moment it is made.

``kaisa train`` writes its curve to ``results.json`` only when the run ends.
The larger tasks' runs take tens of minutes on a shared machine, and an arm
that has passed every target of interest need not run to the end of its
schedule: with this wrapper its curve so far is in the log (one ``EVAL`` line
per reading: step, metric, training loss, training time, the process's CPU
seconds and the 1-minute load), so it can be stopped there without losing it.
Arguments are ``kaisa``'s; the training itself is the real command's, unchanged.

    python benchmarks/train_logged.py train --task text-lm-large --no-kfac ... > run.log
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import kaisa_lab.cli.train as _train
from kaisa_lab.cli.main import main

_record = _train._record


def _logged(result: Any, record: Any, reached: bool) -> None:
    print(
        f"EVAL step {record.step} metric {record.metric:.4f} train_loss {record.train_loss:.4f} "
        f"train_time {record.wall_time_s:.1f} cpu {time.process_time():.1f} "
        f"load {os.getloadavg()[0]:.2f} wall {time.time():.0f}",
        flush=True,
    )
    _record(result, record, reached)


if __name__ == "__main__":
    _train._record = _logged
    sys.exit(main(sys.argv[1:]))
