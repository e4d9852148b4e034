"""The benchmark suite's one result schema: a JSON record per run, and where records live.

Every figure the reports show is computed from these records, never typed in,
so a record carries everything needed to judge and reproduce its number:

- ``case``, ``kind`` (``train``: a run to a target; ``timing``: step costs),
  ``arm`` and ``role`` (``grid``, ``followup``, ``heldout`` or ``timing``);
- ``config``: the full configuration the run trained with (for a training
  run, :meth:`kaisa_lab.cli.spec.RunSpec.to_dict`), and ``key``, its digest
  without the seed, so the seeds of one setting are found together;
- ``result``: the outcome (for a training run: steps and time to target on the
  run's own clock, why it stopped, the spread of its step times, and the
  fingerprints of its initial weights and data order);
- ``curve``: every reading of the metric;
- ``environment``: git commit, date, machine (CPU or GPU model, cores),
  threads, the load at the start and the end, and the versions of python,
  torch, kaisa and the baselines' packages.

Records are files ``<root>/<case>/<arm>/<key>-s<seed>.json`` (:class:`RecordStore`),
one per run, so a campaign resumes by skipping runs whose record exists, and
two workers never write the same file.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SCHEMA",
    "RecordStore",
    "config_key",
    "environment",
    "load_average",
    "machine",
    "train_record",
]

#: the schema every record names; a change that renames or drops a field bumps it
SCHEMA = "kaisa-bench-run/1"

#: packages whose versions every record keeps (absent ones recorded as None)
PACKAGES = ("torch", "kaisa", "kaisa-lab", "numpy", "heavyball", "pytorch-optimizer")

#: the repository this module lives in (for the commit; absent in an installed package)
_ROOT = Path(__file__).resolve().parents[4]


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


@functools.lru_cache(maxsize=1)
def _commit() -> dict[str, Any]:
    """The commit of the tree the suite runs from, and whether its source differs from it."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "src", "lab/src")
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the run ran on: the CPU model and cores, and the GPU's name on CUDA."""
    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "device": device.type,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "platform": platform.platform(),
    }


def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__
    return found


def environment(
    device: torch.device | str = "cpu",
    load_start: float | None = None,
    load_end: float | None = None,
) -> dict[str, Any]:
    """Where and when a record was made (its ``environment`` field)."""
    return {
        **_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "threads": torch.get_num_threads(),
        "load_1min": {"start": load_start, "end": load_end},
        "versions": _versions(),
    }


_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _numbers(value: Any) -> Any:
    """The inverse of :func:`_canonical` on outcomes: ``"nan"``/``"inf"`` back to floats."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value


def _canonical(value: Any) -> Any:
    """JSON-ready and deterministic: non-finite floats as strings, mappings sorted."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


#: fields of a configuration that do not change what a run is
_NOT_IDENTITY = ("seed", "name", "lr_tuned")


def _identity(value: Any) -> Any:
    """``value`` without None entries (at any depth): an option added later with a
    None default leaves the key of every earlier run as it was."""
    if isinstance(value, Mapping):
        return {k: _identity(v) for k, v in value.items() if v is not None}
    return value


def _safe(name: str) -> str:
    """A file-name form of an arm's name (spaces and slashes replaced)."""
    return "".join(c if c.isalnum() or c in "+-_.=" else "_" for c in name)


def config_key(config: Mapping[str, Any]) -> str:
    """A short digest of what a run is, without its seed: the seeds of one setting share it.

    A change to what a run is (another value of any option, a new default)
    changes its key, so a campaign never counts a record of another
    configuration as one of its own."""
    body = _identity({k: v for k, v in config.items() if k not in _NOT_IDENTITY})
    text = json.dumps(_canonical(body), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def train_record(
    *,
    case: str,
    arm: str,
    role: str,
    result: Any,
    env: Mapping[str, Any],
    group: str,
    lockstep: Sequence[str],
) -> dict[str, Any]:
    """The record of one training run (a :class:`kaisa_lab.cli.train.RunResult`).

    ``group`` names the lockstep group it stepped in (every run of a group
    records the same), ``lockstep`` the keys of the runs that group started
    with: what a report pairs wall-clock figures by."""
    config = result.spec.to_dict()
    return {
        "schema": SCHEMA,
        "kind": "train",
        "case": case,
        "arm": arm,
        "role": role,
        "seed": result.spec.seed,
        "key": config_key(config),
        "group": group,
        "lockstep": list(lockstep),
        "config": config,
        "result": {
            "metric": result.metric_name,
            "higher_is_better": result.higher_is_better,
            "target": result.spec.target,
            "reached": result.steps_to_target is not None,
            "steps_to_target": result.steps_to_target,
            "time_to_target_s": result.time_to_target_s,
            "cpu_time_to_target_s": result.cpu_time_to_target_s,
            "steps": result.curve[-1].step if result.curve else 0,
            "train_time_s": result.wall_time_s,
            "final_metric": result.final_metric,
            "stopped": result.stopped,
            "step_times": None if result.step_times is None else asdict(result.step_times),
            "fingerprints": {
                "initial_weights": result.initial_weights,
                "data_order": result.data_order,
            },
            # only where a snapshot was restored: the clock then sums several processes'
            **({"resumed_at": list(result.resumed_at)} if result.resumed_at else {}),
        },
        "curve": [
            {
                "step": r.step,
                "time_s": r.wall_time_s,
                "cpu_s": r.cpu_time_s,
                "train_loss": r.train_loss,
                "metric": r.metric,
            }
            for r in result.curve
        ],
        "environment": dict(env),
    }


class RecordStore:
    """Records under one folder: ``<root>/<case>/<arm>/<key>-s<seed>.json`` for a
    training run, ``<root>/<case>/<arm>/<key>-<run>.json`` for a timing (``run``:
    when the measurement was made, so re-measuring adds records)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path(self, case: str, arm: str, key: str, seed: int) -> Path:
        return self.root / case / _safe(arm) / f"{key}-s{seed}.json"

    def has(self, case: str, arm: str, key: str, seed: int) -> bool:
        return self.path(case, arm, key, seed).exists()

    def write(self, record: Mapping[str, Any]) -> Path:
        """Write a record atomically (a half-written file never counts as done)."""
        if record["kind"] == "timing":
            run = str(record["run"]).replace(":", "")
            path = self.root / record["case"] / _safe(record["arm"]) / f"{record['key']}-{run}.json"
        else:
            path = self.path(record["case"], record["arm"], record["key"], record["seed"])
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(_canonical(record), indent=1) + "\n")
        partial.replace(path)
        return path

    def read(self, case: str) -> Iterator[dict[str, Any]]:
        """Every record of ``case``, in path order (non-finite numbers restored)."""
        for path in sorted((self.root / case).glob("*/*.json")):
            record = json.loads(path.read_text())
            for field in ("result", "curve"):
                if field in record:
                    record[field] = _numbers(record[field])
            yield record

    def cases(self) -> list[str]:
        return (
            sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.exists() else []
        )
