"""Snapshots of runs in flight: a long lockstep group stops and goes on without redoing steps.

A tuning campaign's group of runs can outlast a worker's time on the
machine (text-lm-large's ten settings of one arm take hours in lockstep).
Records are written per finished run, so without snapshots a group stopped
part-way would start again from step 0. A snapshot holds everything a run's
next steps depend on (:meth:`kaisa_lab.cli.trainer.Trainer.state_dict`, its
random state, its place in the data, its clock and curve so far); it is
taken off the clock at the end of a round, at most every ``every_s``
seconds, and restored bit for bit: a resumed run's curve equals the
uninterrupted run's. Its clock goes on from the saved total, so its time
sums the clocks of more than one process; the steps it was resumed at are
kept in its result (and record) so a reader can tell.

Files are ``<root>/<digest of the run's config>.pt``, written whole (a
partial file is renamed into place) and deleted when the run ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kaisa_lab.cli.spec import RunSpec

__all__ = ["Snapshots"]


class Snapshots:
    """Where the snapshots of one campaign's runs in flight live, and how often they are taken."""

    def __init__(self, root: Path | str, every_s: float = 600.0) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 seconds; got {every_s}")
        self.root = Path(root)
        self.every_s = every_s
        self._last = time.monotonic()

    def path(self, spec: RunSpec | Mapping[str, Any]) -> Path:
        """The file of a run (its spec, or the config its record keeps)."""
        config = spec.to_dict() if isinstance(spec, RunSpec) else dict(spec)
        text = json.dumps(config, sort_keys=True, default=str)
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.pt"

    def due(self) -> bool:
        """Whether ``every_s`` has passed since the last :meth:`saved`."""
        return time.monotonic() - self._last >= self.every_s

    def saved(self) -> None:
        """Start the interval to the next snapshot afresh."""
        self._last = time.monotonic()

    def save(self, spec: RunSpec, state: dict[str, Any]) -> None:
        """Write ``state`` (a run's, as :meth:`kaisa_lab.cli.train` takes it) whole."""
        path = self.path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".pt.partial")
        torch.save({"config": spec.to_dict(), "state": state}, partial)
        os.replace(partial, path)

    def load(self, spec: RunSpec) -> dict[str, Any] | None:
        """The state saved for ``spec`` (None: none, or one of another config)."""
        path = self.path(spec)
        if not path.exists():
            return None
        # written by this module, for this machine's own resumes: not untrusted input
        saved = torch.load(path, map_location="cpu", weights_only=False)
        if saved.get("config") != spec.to_dict():
            return None
        state: dict[str, Any] = saved["state"]
        return state

    def discard(self, spec: RunSpec | Mapping[str, Any]) -> None:
        self.path(spec).unlink(missing_ok=True)
