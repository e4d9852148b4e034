"""What recording a step takes: a recorder (a CUDA graph, or a test's
emulation), the error of a step that ran but could not be recorded, and the
stamp of the gradients a replay leaves (:mod:`kaisa.step.graphed` records
and replays with them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from kaisa.engines.base import GradientMarks

__all__ = [
    "CUDA_GRAPH_MODES",
    "NO_KEY",
    "CudaGraphRecorder",
    "Key",
    "Recorder",
    "RecordingError",
    "ReplayStamp",
    "Work",
]

#: ``torch.compile`` modes that ask for CUDA graphs, and the mode the groups'
#: kernel is compiled with inside the recorded step (no graphs of its own)
CUDA_GRAPH_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


#: the recorded work: the application, and the verdict counted (device work only)
Work = Callable[[], None]


class Recorder(Protocol):
    """Records a piece of work once and replays it (a CUDA graph; the tests
    on CPU emulate one: tests/unit/step/test_graphed.py)."""

    def record(self, work: Work) -> None:
        """Run ``work`` for this step and record it."""
        ...

    def replay(self) -> None:
        """Run the recorded work again."""
        ...


class RecordingError(Exception):
    """The work ran (this step is complete) but could not be recorded."""

    def __init__(self) -> None:
        super().__init__("the step's work ran but could not be recorded")


class CudaGraphRecorder:
    """:class:`Recorder` as a ``torch.cuda.CUDAGraph``: the work runs once
    eagerly on a side stream (this step's result, and every cache built
    outside the recording), then is recorded without running."""

    def __init__(self) -> None:
        self._graph: torch.cuda.CUDAGraph | None = None

    def record(self, work: Work) -> None:
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            work()
        main.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                work()
        except Exception as error:  # this step's work is done: the warm-up ran it
            raise RecordingError() from error
        self._graph = graph

    def replay(self) -> None:
        assert self._graph is not None, "replay() before record()"
        self._graph.replay()


Key = tuple[object, ...]
#: the key of no recording (matches no step's)
NO_KEY: Key = ((), None, None)


class ReplayStamp:
    """The gradients as a replay left them (a
    :class:`~kaisa.engines.base.MarksStamp`): the graph's tensors, each at
    its version, and the other layers' marks.  A backward since makes new
    tensors or moves a version; a second ``step()`` without one finds them
    as stamped — told apart without a weak reference per layer."""

    __slots__ = ("_held", "_others", "_params", "_versions")

    def __init__(
        self, params: list[nn.Parameter], held: list[Tensor], others: list[nn.Parameter]
    ) -> None:
        self._params = params
        self._held = held
        self._versions = [h._version for h in held]
        self._others = [(w, GradientMarks.of(w.grad)) for w in others]

    def unchanged(self) -> bool:
        for p, h, v in zip(self._params, self._held, self._versions):
            if p.grad is not h or h._version != v:
                return False
        return all(GradientMarks._same(old, GradientMarks.of(w.grad)) for w, old in self._others)
