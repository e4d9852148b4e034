"""One forward call's factor terms, and their commit once its output gradient arrives.

What :class:`kaisa.step.capture.calls.Capture`'s hooks do with a call: the
input terms formed at forward (shared by the layers that read one input),
then, with the output gradient, every statistic the method declared —
through the layer's adapter for a factor, through the method's
:meth:`~kaisa.methods.base.CurvatureMethod.joint_term` for a joint one —
added to the layer's batch sums.  A profile, while attached, times each
term by its layer type (:mod:`kaisa.step.profile`).
"""

from __future__ import annotations

from torch import Tensor

from kaisa.core.specs import FactorSource, FactorSpec
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.step.capture.graph import joint_term
from kaisa.step.capture.hooks import TermMemo, input_term_key
from kaisa.step.profile import StepProfile

__all__ = ["PassKey", "commit_call", "input_terms", "needs_input", "timed_term"]


def input_terms(
    layer: KFACLayer, x: Tensor, memo: TermMemo | None = None, profile: StepProfile | None = None
) -> list[tuple[int, Tensor, float]]:
    """(factor index, contribution, rows) of every input factor for one call.

    ``memo`` is shared by layers that read the same input in one call — the
    q, k and v rows of a self-attention's packed projection — so their common
    input factor is formed once, not three times; a reused term is copied,
    since a layer's sums may start as the very tensor it is given.
    ``profile``: the terms are timed (:mod:`kaisa.step.profile`)."""
    out = []
    adapter = layer.adapter
    for i, stat in enumerate(layer.statistics):
        if stat.source is not FactorSource.INPUT:
            continue
        assert stat.factor is not None  # an input statistic estimates a factor
        spec = layer.factors[stat.factor]
        key = input_term_key(layer, spec)
        found = None if memo is None else memo.get(key)
        if found is not None:
            out.append((i, found[0].clone(), found[1]))
            continue
        if profile is None:
            term, rows_count = adapter.factor_term(spec, x, layer.factor_dtype, 1.0)
        else:
            term, rows_count = timed_term(profile, "A", layer, spec, x)
        if memo is not None:
            memo[key] = (term, rows_count)
        out.append((i, term, rows_count))
    return out


def timed_term(
    profile: StepProfile,
    source: str,
    layer: KFACLayer,
    spec: FactorSpec,
    tensor: Tensor,
    scale: float | Tensor = 1.0,
) -> tuple[Tensor, float]:
    """One factor term and its rows, its time charged to its layer type's phase
    (:mod:`kaisa.step.profile`) and its rows kept."""
    adapter = layer.adapter
    since = profile.start()
    term, rows = adapter.factor_term(spec, tensor, layer.factor_dtype, scale)
    phase = profile.term(source, adapter.module)
    profile.stop(phase, since)
    profile.record(phase, spec.kind.value, (int(rows), spec.dim))
    return term, rows


PassKey = tuple[int, int]


def needs_input(layer: KFACLayer) -> bool:
    """Whether a call's input must wait for its output gradient: a declared
    statistic is formed from both (``JOINT``)."""
    return any(s.source is FactorSource.JOINT for s in layer.statistics)


def commit_call(
    layer: KFACLayer,
    inputs: list[tuple[int, Tensor, float]],
    g: Tensor,
    batch: int,
    multiplier: float | Tensor,
    pass_id: PassKey,
    x: Tensor | None = None,
    method: CurvatureMethod | None = None,
    profile: StepProfile | None = None,
) -> None:
    """Add one call's terms to the layer's sums: the input terms formed at
    forward, then every statistic the method declared from the output
    gradient — through the adapter for a factor, through the method's
    :meth:`~kaisa.methods.base.CurvatureMethod.joint_term` (with the call's
    input ``x``) for a joint one.  Output-gradient and joint statistics count
    the data points of each pass once.  ``profile``: the G terms are timed."""
    stats = layer.batch
    for i, value, count in inputs:
        stats.add(i, value)
        stats.counts[i] += count
    new_pass = stats.new_pass(pass_id)
    scale = multiplier * multiplier
    adapter = layer.adapter
    for i, stat in enumerate(layer.statistics):
        if stat.source is FactorSource.OUTPUT_GRAD:
            assert stat.factor is not None
            spec = layer.factors[stat.factor]
            if profile is None:
                stats.add(i, adapter.factor_term(spec, g, layer.factor_dtype, scale)[0])
            else:
                stats.add(i, timed_term(profile, "G", layer, spec, g, scale)[0])
        elif stat.source is FactorSource.JOINT:
            if x is None or method is None:
                raise RuntimeError(f"kaisa: layer {layer.name!r}: a joint statistic needs x")
            term = joint_term(method, layer, stat, x, g, scale)
            if term is None:
                continue
            stats.add(i, term)
        else:
            continue
        if new_pass:
            stats.counts[i] += batch
    stats.calls += 1
