"""What a run prints while it trains: tqdm bars, or one plain line per epoch.

Bars on a terminal only: written into a file or a pipe, a bar's carriage-return
updates fill a log with thousands of half-lines, so there (and with
``--quiet``) a run prints one plain line per epoch. Ranks other than 0 print
nothing, so a ``torchrun`` job shows one bar.
With several seeds a second bar counts finished runs (seeds x arms); the epoch
bars then vanish when done and leave one summary line each, so the screen
keeps the runs bar and a readable log instead of a stack of finished bars.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

import torch
from tqdm import tqdm

__all__ = ["Progress", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (where a bar's in-place updates render)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


class Progress:
    """Per-epoch progress of one process; silent when ``enabled`` is false."""

    #: Refresh the loss shown on the bar every this many steps: reading a loss
    #: forces the device to finish its queued work, which would slow CUDA runs.
    refresh_every = 10

    def __init__(self, enabled: bool, bars: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.bars = bars and enabled and is_terminal(self.stream)
        self._bar: tqdm[object] | None = None
        self._runs: tqdm[object] | None = None
        self._steps = 0

    def start_runs(self, total: int) -> None:
        """Show a bar over ``total`` runs (call only when there is more than one seed)."""
        if self.bars:
            self._runs = tqdm(
                total=total, desc="runs", unit="run", file=self.stream, leave=True, position=0,
                dynamic_ncols=True,
            )  # fmt: skip

    def end_run(self) -> None:
        """Count a finished run on the runs bar (if shown)."""
        if self._runs is not None:
            self._runs.update(1)

    def close_runs(self) -> None:
        """Close the runs bar (a no-op without one), e.g. before the final table."""
        if self._runs is not None:
            self._runs.close()
            self._runs = None

    def log(self, message: str) -> None:
        """Print a line (without breaking a bar that is on screen)."""
        if not self.enabled:
            return
        if self._bar is not None or self._runs is not None:
            tqdm.write(message, file=self.stream)  # clears and redraws every bar
        else:
            print(message, file=self.stream, flush=True)

    def start_epoch(self, description: str, total: int, done: int = 0) -> None:
        """Show a bar over an epoch's ``total`` steps, ``done`` of them taken already
        (a run resumed part-way through an epoch)."""
        self._steps = 0
        if self.bars:
            self._bar = tqdm(
                total=total,
                initial=done,
                desc=description,
                file=self.stream,
                leave=self._runs is None,
                dynamic_ncols=True,
            )

    def step(self, loss: torch.Tensor) -> None:
        """Advance the bar by one training step whose loss is ``loss``."""
        self._steps += 1
        if self._bar is None:
            return
        self._bar.update(1)
        if self._steps == 1 or self._steps % self.refresh_every == 0:
            self._bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def end_epoch(self, summary: str, values: Mapping[str, float]) -> None:
        """Close the bar showing the epoch's results, or log ``summary`` without bars."""
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in values.items()}, refresh=False)
            self._bar.close()
            self._bar = None
            if self._runs is not None:  # the epoch bar vanished: keep its result
                self.log(summary)
        elif self.enabled:
            self.log(summary)
