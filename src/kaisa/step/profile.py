"""Where a step's time goes, recorded by the step itself while asked (:class:`StepProfile`).

The phases of a K-FAC step run inside ``step()`` and inside the capture
hooks, some of them in places no method of their own marks (the products of
a layer written in place, a stacked group's kernel, the factor terms inside
a hook).  Timed from outside, they would have to be found by wrapping
private methods, which every refactor breaks.  So the step times itself, at
the boundaries where its own code runs each phase, while a profile is
attached (``precond.profile = StepProfile()``): detached, each boundary
costs one test of a local or an attribute, and attaching changes no
computed value.  A profile is to time, not to train with: each boundary
reads the clock (and calls ``sync``, where given, before each reading).

The phases, inclusive, by the names :attr:`StepProfile.seconds` uses:

- ``capture``: every capture hook's work on a factor step's calls (the
  forward's A terms, the backward's G terms, adding the terms up and,
  distributed, the reductions the hooks start);
- ``capture: A (Linear)``, ``capture: G (Linear)``, ... (:func:`term_phase`):
  inside ``capture``, one layer type's input and output-gradient factor
  terms: their rows built and reduced to a Gram (or a diagonal, or counts);
- ``reduce``: the statistics onto their owners, the counts summed;
- ``running average``: the batch factors divided and folded into the running ones;
- ``decomposition``: eigendecompositions or inverses, and their broadcast;
- ``application``: the gradients read, preconditioned, broadcast, KL-clipped
  and written back (a replayed step's replay: all of it);
- ``preconditioning products``: inside ``application``, the method's
  products (a layer's, one written in place, or a stacked group's);
- ``step``: the whole ``step()``.

:meth:`StepProfile.stages` turns them into exclusive parts that add up to
``step`` plus ``capture``.  With ``update_factors_in_hook=False`` the terms
are formed in ``reduce`` instead (its time includes them).  Where a step
is replayed (:mod:`kaisa.step.graphed`), the recording runs without the
profile's clock (a graph holds no host work), so its products show only as
``application``.

With ``record_shapes=True`` it also keeps what each timed piece worked on
(:class:`Operation`): enough to time the same arithmetic on bare kernels
of the same shapes, the floor each stage could reach.  Each step's path
is kept too (:attr:`StepProfile.steps`: a factor step, a non-factor one, a
replayed one or a skipped one).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kaisa.core.specs import FactorKind, FactorSpec

__all__ = [
    "APPLY",
    "BOOKKEEPING",
    "CAPTURE",
    "DECOMPOSE",
    "DETACHED",
    "FACTOR",
    "FOLD",
    "HOOKS_AND_SUMS",
    "KL_AND_WRITE",
    "NON_FACTOR",
    "PRODUCTS",
    "REDUCE",
    "REPLAYED",
    "SKIPPED",
    "STEP",
    "Operation",
    "StepProfile",
    "factor_sizes",
    "term_phase",
]

CAPTURE = "capture"
REDUCE = "reduce"
FOLD = "running average"
DECOMPOSE = "decomposition"
APPLY = "application"
PRODUCTS = "preconditioning products"
STEP = "step"

#: a step's path (:attr:`StepProfile.steps`): statistics folded (the step's factor step)
FACTOR = "factor"
#: the gradients preconditioned eagerly, nothing folded
NON_FACTOR = "non-factor"
#: the application replayed (:mod:`kaisa.step.graphed`)
REPLAYED = "replayed"
#: skipped whole (non-finite gradients, or the grad scaler's verdict)
SKIPPED = "skipped"

#: the exclusive parts :meth:`StepProfile.stages` derives, after the terms
HOOKS_AND_SUMS = "capture: hooks and sums"
KL_AND_WRITE = "KL clip + write-back"
BOOKKEEPING = "step() bookkeeping"

_TERM_ORDER = {"A": 0, "G": 1}


def term_phase(source: str, layer_type: str) -> str:
    """The phase of one layer type's factor terms: ``source`` ``'A'`` or ``'G'``."""
    return f"capture: {source} ({layer_type})"


@dataclass(frozen=True)
class Operation:
    """What one timed piece of a phase worked on (kept with ``record_shapes=True``).

    ``kind`` says how to read ``shape``:

    - a factor term: the factor's kind (``'dense'``, ``'diagonal'``,
      ``'block_diagonal'``) and ``(rows, features)``, the rows it reduced;
    - ``'fold'``: a batch factor folded into its running average (its shape);
    - ``'eigh'`` or ``'inverse'`` (the method's kernel): one dense factor
      decomposed, ``(d, d)``;
    - ``'products'``: a gradient preconditioned, ``[g, a]`` or a stacked
      group's ``[L, g, a]``; ``factors`` then holds each matrix axis's dense
      factor size (0 where that factor is not dense).
    """

    phase: str
    kind: str
    shape: tuple[int, ...]
    factors: tuple[int, ...] = ()


def factor_sizes(factors: Sequence[FactorSpec], axes: int = 2) -> tuple[int, ...]:
    """Per matrix axis, the size of its dense factor (0: none, or not dense)."""
    sizes = [0] * axes
    for spec in factors:
        if spec.axis < axes and spec.kind is FactorKind.DENSE:
            sizes[spec.axis] = spec.dim
    return tuple(sizes)


class StepProfile:
    """Wall time of each phase of the step while attached (``precond.profile = ...``).

    Args:
        sync: called before each reading of the clock; on a GPU
            ``torch.cuda.synchronize``, so queued work is charged to the phase
            that launched it (None: CPU work is synchronous).
        record_shapes: also keep an :class:`Operation` per timed piece.
        clock: seconds, monotonic (``time.perf_counter``; ``time.process_time``
            for CPU time).
    """

    def __init__(
        self,
        *,
        sync: Callable[[], object] | None = None,
        record_shapes: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.sync = sync
        self.record_shapes = record_shapes
        self.clock = clock
        #: seconds per phase, summed over the steps since attached (or cleared)
        self.seconds: defaultdict[str, float] = defaultdict(float)
        #: how many times each phase ran
        self.calls: defaultdict[str, int] = defaultdict(int)
        #: what each timed piece worked on (``record_shapes``), in order
        self.operations: list[Operation] = []
        #: each step's path (:data:`FACTOR`, :data:`NON_FACTOR`, :data:`REPLAYED`,
        #: :data:`SKIPPED`) and its seconds
        self.steps: list[tuple[str, float]] = []
        self._term_phases: dict[tuple[str, type], str] = {}

    # -- called by the step --------------------------------------------------
    def start(self) -> float:
        """The clock at a phase's start (after ``sync``)."""
        if self.sync is not None:
            self.sync()
        return self.clock()

    def stop(self, phase: str, started: float) -> float:
        """Charge ``phase`` with the time since ``started``; returns the clock."""
        if self.sync is not None:
            self.sync()
        now = self.clock()
        self.seconds[phase] += now - started
        self.calls[phase] += 1
        return now

    def end_step(self, path: str, started: float) -> None:
        """The step that began at ``started`` is done, by ``path``."""
        now = self.stop(STEP, started)
        self.steps.append((path, now - started))

    def term(self, source: str, module: object) -> str:
        """The phase of ``module``'s ``source`` terms (its name made once per type)."""
        key = (source, type(module))
        found = self._term_phases.get(key)
        if found is None:
            found = self._term_phases[key] = term_phase(source, type(module).__name__)
        return found

    def record(
        self, phase: str, kind: str, shape: Sequence[int], factors: tuple[int, ...] = ()
    ) -> None:
        """Keep what a piece of ``phase`` worked on (where ``record_shapes``)."""
        if self.record_shapes:
            self.operations.append(Operation(phase, kind, tuple(int(s) for s in shape), factors))

    # -- read by the user ----------------------------------------------------
    def stages(self) -> dict[str, float]:
        """Exclusive seconds per part, in the order a step runs them; they add
        up to ``step`` plus ``capture``:

        the factor terms (per layer type, A then G), ``capture: hooks and
        sums`` (the rest of the hooks), ``reduce``, ``running average``,
        ``decomposition``, ``preconditioning products``, ``KL clip +
        write-back`` (the rest of ``application``) and ``step()
        bookkeeping`` (the rest of ``step``: the checks, the schedule, the
        marks)."""
        s = self.seconds
        terms = [k for k in s if k.startswith("capture: ")]

        def order(name: str) -> tuple[str, int]:
            source, _, kind = name.removeprefix("capture: ").partition(" (")
            return kind, _TERM_ORDER.get(source, 2)

        out = {k: s[k] for k in sorted(terms, key=order)}
        out[HOOKS_AND_SUMS] = s.get(CAPTURE, 0.0) - sum(out.values())
        phases = (REDUCE, FOLD, DECOMPOSE, APPLY)
        for phase in phases[:-1]:
            out[phase] = s.get(phase, 0.0)
        out[PRODUCTS] = s.get(PRODUCTS, 0.0)
        out[KL_AND_WRITE] = s.get(APPLY, 0.0) - out[PRODUCTS]
        out[BOOKKEEPING] = s.get(STEP, 0.0) - sum(s.get(p, 0.0) for p in phases)
        return out

    def clear(self) -> None:
        """Forget everything recorded (the attachment stays)."""
        self.seconds.clear()
        self.calls.clear()
        self.operations.clear()
        self.steps.clear()


class Detached:
    """The boundaries of a step no profile is attached to: each a no-op, so
    the pipeline marks its phases the same way attached or not."""

    __slots__ = ()

    def start(self) -> float:
        return 0.0

    def stop(self, phase: str, started: float) -> float:
        return 0.0

    def end_step(self, path: str, started: float) -> None:
        return None


#: the boundaries while no profile is attached
DETACHED = Detached()
