"""The engine interface: how one training engine exposes gradients to kaisa.

An engine is the only thing that knows where a layer's gradient lives
(``param.grad`` after DDP's all-reduce; later DeepSpeed's partitions or an
FSDP2 shard), how to write the preconditioned gradient back, how to find the
user's model inside its wrapper, and whether this step's gradients are
valid.  Everything else in kaisa sees the canonical ``[d_out, d_in(+1)]``
gradient matrix of a layer.

To add an engine: subclass :class:`Engine` (start from
:mod:`kaisa.engines.pytorch`), implement the capability protocols it has,
and teach :func:`kaisa.engines.select_engine` to pick it.  Its collectives
belong in :mod:`kaisa.distributed` (no engine imports ``torch.distributed``).
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from kaisa.layers.base import LayerAdapter

if TYPE_CHECKING:
    from kaisa.config import KFACConfig
    from kaisa.core.workspace import Workspace
    from kaisa.distributed.communicator import Communicator
    from kaisa.layers.registry import SkippedModule
    from kaisa.layers.state import KFACLayer
    from kaisa.step.capture.calls import Capture

__all__ = [
    "Engine",
    "EngineDefaults",
    "GradientMarks",
    "InPlaceGradients",
    "MarksStamp",
    "ModelParallelLayers",
    "OwnsTheLoop",
    "ReplayableGradients",
    "ShardedReads",
    "assemble_by_workers",
    "unique_parameters",
]


@dataclass(frozen=True)
class EngineDefaults:
    """What an engine knows about the training run that the user need not repeat.

    Attributes:
        accumulation_steps: micro-batches per optimizer step, where the engine
            divides the loss by it (DeepSpeed); ``None``: the user says.
        lr: the learning rate now, for the KL clip; ``None``: from the
            optimizer or the ``lr`` argument.
        topology: the engine's own data- and model-parallel groups.
        loss_scale: the current loss scale where the engine scales the loss.
        loss_divisor: what each micro-batch's loss is divided by before its
            backward.  ``None``: ``accumulation_steps``, as in a hand-written
            accumulation loop or DeepSpeed; ``1`` where the engine divides the
            accumulated *gradients* instead (a pipelining schedule's
            ``scale_grads``), so the output gradients kaisa sees were not
            divided and G must not undo a division that never happened.
    """

    accumulation_steps: int | None = None
    lr: Callable[[int], float] | None = None
    topology: Any = None
    loss_scale: Callable[[], float] | None = None
    loss_divisor: int | None = None


class Engine(ABC):
    """Reads, writes and validates the gradients of registered layers.

    The required interface: what every engine answers, at every step.  What
    only some engines do is a capability they opt into by implementing one
    of the small protocols below (:class:`InPlaceGradients`,
    :class:`ShardedReads`, :class:`ModelParallelLayers`,
    :class:`OwnsTheLoop`); the step asks ``isinstance(engine, ...)`` once,
    where it is built (a runtime protocol check costs microseconds), and
    never calls a default that does nothing.
    """

    name: str = "engine"

    @abstractmethod
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside any wrapper, so layer names do not depend on it."""

    @abstractmethod
    def read(self, adapter: LayerAdapter) -> Tensor | None:
        """The layer's full, averaged gradient matrix, or None if it has none this step."""

    @abstractmethod
    def write(self, adapter: LayerAdapter, matrix: Tensor) -> None:
        """Overwrite the layer's gradient with ``matrix`` (same layout as :meth:`read`)."""

    @abstractmethod
    def gradient_marks(self, adapters: Sequence[LayerAdapter]) -> Iterable[Any]:
        """Something per layer that changes whenever a backward pass writes its
        gradient (see :class:`GradientMarks`); may be lazy (a generator): the
        check after a backward stops at the first layer whose mark moved."""

    def present(self, adapter: LayerAdapter) -> bool:
        """Whether the layer has a gradient this step, known without assembling it."""
        return self.read(adapter) is not None

    def step_is_valid(self) -> bool | Tensor:
        """Whether this step's gradients may be used, by the engine's own loss
        scaler (DeepSpeed fp16); a ``torch.amp.GradScaler`` is read by the
        pipeline for every engine."""
        return True

    def local_gradients(self, adapters: Sequence[LayerAdapter]) -> list[Tensor]:
        """The gradient tensors this rank holds for ``adapters``' parameters —
        whole, or its part of a partitioned one — for the check that skips a
        step whose gradients are not finite (:mod:`kaisa.step.nonfinite`).  Default:
        each ``param.grad``, a DTensor's local shard."""
        out = []
        for p in unique_parameters(adapters):
            grad = p.grad
            if grad is not None:
                to_local = getattr(grad, "to_local", None)
                out.append(to_local() if callable(to_local) else grad)
        return out

    def gradients_agree(self) -> bool:
        """Whether every data-parallel rank is known to hold a gradient for the
        same layers (DDP guarantees it); if not, ranks agree by a collective."""
        return False

    def defaults(self) -> EngineDefaults:
        """Settings the engine supplies where the user left them out."""
        return EngineDefaults()


@runtime_checkable
class InPlaceGradients(Protocol):
    """The CPU workspace fast path: gradients that are plain tensors kaisa may
    overwrite in place (:class:`~kaisa.engines.pytorch.TorchEngine`).

    Such a layer writes its ``V`` as soon as it is formed, before the KL
    clip's ``ν`` (known only once every layer's ``⟨V, ∇⟩`` is), and is
    scaled by ``ν`` afterwards, so no ``V`` is held and the products of the
    large layers reuse one workspace (:mod:`kaisa.core.workspace`); where the
    method can, it reads ``∇W``/``∇b`` and writes ``V`` over them directly."""

    def rescalable(self, adapters: Sequence[LayerAdapter]) -> list[bool]:
        """Which of the registered layers ``adapters`` may have their gradients
        written at once and scaled in place by :meth:`rescale` afterwards (the
        others hold ``V`` and are written ``ν·V``)."""
        ...

    def rescale(self, adapters: Sequence[LayerAdapter], nu: Tensor | float) -> None:
        """Multiply the written gradients of ``adapters`` by ``nu`` (only
        layers :meth:`rescalable` allowed)."""
        ...

    def write_many(self, adapters: Sequence[LayerAdapter], matrices: Sequence[Tensor]) -> None:
        """:meth:`Engine.write` of several layers at once, as one foreach copy
        (only layers :meth:`rescalable` allowed): on an accelerator one
        launch per chunk of tensors, not two per layer."""
        ...

    def read_into(self, adapter: LayerAdapter, work: Workspace | None) -> Tensor | None:
        """:meth:`Engine.read`, copying where a copy is needed into ``work``'s
        gradient buffer (only for layers :meth:`rescalable` allowed)."""
        ...

    def grad_blocks(self, adapter: LayerAdapter) -> list[Tensor] | None:
        """The layer's gradient matrix as column blocks that *are* its
        parameters' gradients (:meth:`LayerAdapter.grad_blocks`), for the
        curvature method to read and then overwrite with ``V`` (only on the
        :meth:`rescalable` layers); None where it cannot for this layer."""
        ...


@runtime_checkable
class ShardedReads(Protocol):
    """Gradients partitioned over ranks (FSDP2's rows, DeepSpeed's ZeRO
    partitions, tensor-parallel shards): a layer's full gradient is assembled
    only on the ranks that use it — its gradient workers.  Without this
    protocol every rank reads every layer with :meth:`Engine.read`."""

    def read_many(
        self, adapters: Sequence[LayerAdapter], workers: Sequence[Sequence[int]]
    ) -> list[Tensor | None]:
        """The full gradients of ``adapters`` (all present on every rank), where
        ``workers[i]`` (global ranks) are the ranks that must receive layer
        ``i``'s.  Every rank calls this with the same layers in the same order,
        so the engine may gather each one onto its workers only; other ranks
        may get ``None``."""
        ...

    def gradient_dtype(self, adapter: LayerAdapter) -> torch.dtype:
        """The dtype :meth:`read_many` returns for the layer, for the receive
        buffers of the ranks that got ``None``."""
        ...


@runtime_checkable
class ModelParallelLayers(Protocol):
    """An engine that divides a layer's work over ranks outside the
    data-parallel group (tensor parallelism): it chooses this rank's layers,
    feeds some statistics itself, counts replicated layers once in the KL
    clip and finishes writes that need every rank."""

    def select_layers(
        self, adapters: list[LayerAdapter], skipped: list[SkippedModule], config: KFACConfig
    ) -> list[LayerAdapter]:
        """The adapters this rank's work plan holds (a sharded layer kept on
        one tensor-parallel rank, or replaced by its shard's blocks).  May
        append to ``skipped`` what it cannot handle."""
        ...

    def connect(self, comm: Communicator, capture: Capture, layers: list[KFACLayer]) -> None:
        """Join the built parts: register the hooks that feed ``layers``'
        statistics the engine gathers itself with ``capture``, and record its
        own traffic in ``comm.stats``."""
        ...

    def counts_in_kl(self, adapter: LayerAdapter) -> bool:
        """Whether this rank adds the layer's ``⟨V, ∇⟩`` to the KL clip's sum
        over the model-parallel groups: False where another rank of those
        groups holds the same replicated layer and counts it."""
        ...

    def after_write(self) -> None:
        """Called on every rank once :meth:`Engine.write` has run for every
        layer of the step (the scatter of preconditioned shards)."""
        ...


@runtime_checkable
class ReplayableGradients(Protocol):
    """Gradients a recorded CUDA graph may read and overwrite on replay
    (:mod:`kaisa.step.graphed`): plain ``param.grad`` tensors, found where a
    recording left them, with no engine code between the graph and them."""

    def replayable(self) -> bool:
        """Whether this engine's gradients are such tensors (asked once)."""
        ...


@runtime_checkable
class OwnsTheLoop(Protocol):
    """An engine that runs part of the training loop itself (DeepSpeed,
    pipelining): kaisa must fit its layout, its accumulation boundary and,
    where the user cannot call ``step()``, its loop.  An engine that
    subclasses this protocol inherits the methods it does not override,
    which accept everything."""

    def attach(
        self, step: Callable[[], object], paused: Callable[[], AbstractContextManager[None]]
    ) -> Any:
        """Hook kaisa into the engine's own loop: run ``step`` where the user
        cannot call it (DeepSpeed's pipeline engine), and run the engine's
        internal passes that are not training passes (a pipelining schedule's
        shape inference) inside ``paused()`` so they are never captured.
        Returns a handle with ``remove()``, or None where there is nothing to
        hook (the user calls ``precond.step()`` as usual)."""
        return None

    def check_topology(self, topology: Any) -> None:
        """Raise if ``topology`` (the user's, or :meth:`Engine.defaults`')
        cannot be the engine's layout: a pipeline stage whose KL clip would
        not sum over the other stages, say."""
        return None

    def check_step(self) -> None:
        """Raise if ``step()`` is called where the engine's gradients are not
        ready (off an accumulation boundary, say)."""
        return None

    def skips_update(self) -> str | None:
        """Where the engine steps its own optimizer: how its next update is
        kept from changing anything after a step kaisa skipped for
        non-finite gradients, in the skip report's words.  None: the user
        steps the optimizer (kaisa takes the gradients from ``optimizer=``,
        as under any engine; :mod:`kaisa.step.skip`)."""
        return None

    def mark_update(self, skipped: bool) -> None:
        """After every ``step()`` of an engine whose :meth:`skips_update` is
        not None: whether that step was skipped for non-finite gradients."""
        return None


def unique_parameters(adapters: Sequence[LayerAdapter]) -> list[nn.Parameter]:
    """Every parameter of ``adapters`` once (a packed q/k/v weight is shared)."""
    return list(dict.fromkeys(p for a in adapters for p in a.parameters()))


class MarksStamp(Protocol):
    """Marks kept by whoever last wrote the gradients (a replayed step,
    :class:`kaisa.step.graphed.ReplayStamp`), cheaper than a mark per layer."""

    def unchanged(self) -> bool:
        """True when the gradients are as stamped: no backward since."""
        ...


class GradientMarks:
    """Tells whether a backward pass has run since the last ``step()``.

    A mark is a weak reference to a gradient tensor and its version counter:
    backward either accumulates in place (the version moves) or creates a new
    tensor.  If no registered layer's mark moved, ``step()`` would
    precondition already preconditioned gradients.  Costs nothing on the hot
    path: no hook, no synchronisation.  A replayed step leaves a
    :class:`MarksStamp` instead (:meth:`stamp`): the gradients are then
    tensors it holds, compared by identity and version without a mark each.
    """

    def __init__(self) -> None:
        self._marks: list[Any] | None = None
        self._stamp: MarksStamp | None = None

    @staticmethod
    def of(grad: Tensor | None) -> Any:
        if grad is None:
            return None
        return (weakref.ref(grad), grad._version)

    @staticmethod
    def _same(old: Any, new: Any) -> bool:
        if old is None or new is None:
            return old is None and new is None
        return old[0]() is new[0]() and old[1] == new[1]

    def unchanged(self, marks: Iterable[Any]) -> bool:
        """True when some gradient exists and none moved since the last step.

        ``marks`` is read lazily and only as far as needed: after a backward
        the first layer's mark has moved (one read, where a whole list would
        cost a microsecond per layer of cache-cold reads on every step)."""
        if self._stamp is not None:
            return self._stamp.unchanged()
        if self._marks is None:
            return False
        present = False
        for old, new in zip(self._marks, marks):
            if not self._same(old, new):
                return False
            present = present or new is not None
        return present

    def record(self, marks: Iterable[Any]) -> None:
        self._marks = list(marks)
        self._stamp = None

    def stamp(self, stamp: MarksStamp) -> None:
        """The gradients as ``stamp`` holds them (it answers :meth:`unchanged`)."""
        self._stamp = stamp
        self._marks = None


Assemble = Callable[[list[nn.Parameter], tuple[int, ...]], "list[Tensor] | None"]


def assemble_by_workers(
    adapters: Sequence[LayerAdapter], workers: Sequence[Sequence[int]], assemble: Assemble
) -> list[list[Tensor] | None]:
    """Each layer's full parameter gradients where it has workers (None elsewhere).

    Layers with the same workers go together through ``assemble(params,
    ranks)`` — one collective per worker set, in the adapters' order, which
    is the same on every rank — and a parameter several layers share (the
    packed q/k/v of an attention) is sent once."""
    out: list[list[Tensor] | None] = [None] * len(adapters)
    by_workers: dict[tuple[int, ...], list[int]] = {}
    for i, ranks in enumerate(workers):
        by_workers.setdefault(tuple(sorted(ranks)), []).append(i)
    for ranks, indices in by_workers.items():
        unique = list(dict.fromkeys(p for i in indices for p in adapters[i].parameters()))
        full = assemble(unique, ranks)
        if full is None:
            continue
        by_param = dict(zip(unique, full))
        for i in indices:
            out[i] = [by_param[p] for p in adapters[i].parameters()]
    return out
