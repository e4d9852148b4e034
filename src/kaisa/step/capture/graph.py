"""Capture inside a compiled region: the graph forms the statistics itself.

The eager capture (:mod:`kaisa.step.capture.calls`) registers a tensor hook
on each call's output and asks autograd's engine which backward is running;
dynamo can trace neither, so under ``torch.compile`` every registered layer
split the graph (5–34 graphs per forward where the plain model is one).

Here a call's output goes through :class:`_Statistics`, an autograd
function that is the identity forward (a copy: an in-place activation may
follow) and whose backward forms every term the layer's statistics need —
from the saved input and the arriving output gradient — and returns them
as the gradients of *sinks*: per-layer leaf tensors that require grad but
belong to no optimizer.  Autograd accumulates the sinks like parameters, so
nothing calls back into Python during the step and both passes trace into
whole graphs (a factor step and a non-factor step are two compiled variants:
the forward hook reads ``Capture.enabled``).  The sinks bring the eager
capture's rules with them for free: a forward never backpropagated adds
nothing, a backward that does not accumulate into leaves
(``torch.autograd.grad`` of an input gradient) adds nothing, and micro-
batches accumulate.

What the graph cannot hold is read when ``step()`` collects the sinks
(:meth:`GraphCapture.collect`, factor steps only, one host read of the
counts): the loss scale and ``loss_items`` (numbers that change between
steps; dividing them out there keeps the graph free of guards on them), and
the number of backward passes that reached the layer (a post-accumulate hook
on its count sink counts them), which sets an output-gradient statistic's
count when a layer is called several times per pass.

A sink is a zero-strided leaf (one element of storage): it costs nothing
until its gradient exists, and that gradient is the sum the eager capture
would have formed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kaisa import torch_support
from kaisa.config import LossAverage
from kaisa.core.specs import FactorSource, StatisticSpec
from kaisa.core.statistics import grad_multiplier
from kaisa.distributed.messages import COUNT_DTYPE
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.step.capture.hooks import TermMemo, input_term_key

__all__ = ["GraphCapture", "joint_term"]

#: the counts' dtype: exact integers well past float32's 2**24 rows
_FORMED = (FactorSource.INPUT, FactorSource.OUTPUT_GRAD, FactorSource.JOINT)


def _sink(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A leaf of ``shape`` that requires grad, backed by one element."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape).detach().requires_grad_()


class _Sinks:
    """One layer's sinks: a term sink per statistic formed here (None for
    those the method forms elsewhere) and a count sink ``[statistics + 1]``:
    rows or data points per statistic, then the calls."""

    def __init__(self, layer: KFACLayer, device: torch.device) -> None:
        self.device = device
        self.terms: list[Tensor | None] = [
            _sink(stat.shape, layer.dtype_of(stat), device) if stat.source in _FORMED else None
            for stat in layer.statistics
        ]
        self.count = _sink((len(layer.statistics) + 1,), COUNT_DTYPE, device)
        self.passes = 0

    def leaves(self) -> list[Tensor]:
        return [t for t in self.terms if t is not None] + [self.count]

    def clear(self) -> None:
        for leaf in self.leaves():
            leaf.grad = None
        self.passes = 0


#: the layers one call feeds: each with the columns of the output that are its own
#: (a packed projection: q, k and v of one ``F.linear``), or None for all of them
Parts = list[tuple[KFACLayer, slice | None]]


class _Statistics(torch.autograd.Function):
    """Identity on a call's output whose backward returns the call's terms
    as the gradients of its layers' sinks (see the module docstring)."""

    @staticmethod
    def forward(
        out: Tensor, x: Tensor, owner: GraphCapture, parts: Parts, *sinks: Tensor
    ) -> Tensor:
        return out.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, x, owner, parts, *_ = inputs
        ctx.save_for_backward(x)
        ctx.owner = owner
        ctx.parts = parts

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        grads: list[Tensor] = []
        memo: TermMemo = {}  # the parts share x's input terms
        for layer, columns in ctx.parts:
            g = grad if columns is None else grad[..., columns]
            terms, count = ctx.owner.terms(layer, x, g, memo)
            grads.extend(terms)
            grads.append(count)
        return (grad, None, None, None, *grads)


class GraphCapture:
    """The compiled-region path of :class:`~kaisa.step.capture.calls.Capture`.

    Args:
        layers: the registered layers (their sinks are made here, on each
            layer's device, and again by :meth:`follow` when it moves).
        loss_average: what the loss was averaged over.
        loss_divisor: what each micro-batch's loss was divided by.
        method: the curvature method (its joint statistics, if any).
    """

    def __init__(
        self,
        layers: list[KFACLayer],
        *,
        loss_average: LossAverage,
        loss_divisor: int,
        method: CurvatureMethod | None,
    ) -> None:
        self.loss_average = loss_average
        self.loss_divisor = loss_divisor
        self.method = method
        self._sinks: dict[str, _Sinks] = {}
        #: a compiled call came on a torch below the compile floor: nothing
        #: was captured, and the next ``step()`` raises (:mod:`kaisa.torch_support`)
        self.refused = False
        self.follow(layers)

    def follow(self, layers: list[KFACLayer]) -> None:
        """Sinks on each layer's current device: a model moved after the
        preconditioner was built gets new ones here (at construction and at
        every factor step's collection); until then its compiled calls are
        not captured (:meth:`wrap`), rather than failing in backward."""
        for layer in layers:
            found = self._sinks.get(layer.name)
            device = layer.adapter.device
            if layer.adapter.positions is not None:  # the draws' key, a graph input
                layer.adapter.positions.place(device)
            if found is not None and found.device == device:
                continue
            sinks = _Sinks(layer, device)
            sinks.count.register_post_accumulate_grad_hook(self._pass_counter(sinks))
            self._sinks[layer.name] = sinks

    @staticmethod
    def _pass_counter(sinks: _Sinks) -> Any:
        def counted(_: Tensor) -> None:  # runs once per backward that reached the layer
            sinks.passes += 1

        return counted

    def accepts(self, layer: KFACLayer, module: nn.Module, out: Tensor, enabled: bool) -> bool:
        """Whether a compiled call of ``layer`` is captured (read at trace time,
        so each answer is a guard of the compiled variant).  Below the compile
        floor none is, and the refusal is noted for ``step()`` to raise: an
        error raised here, inside the trace, would only make dynamo run the
        forward eagerly."""
        if not torch_support.COMPILE_SUPPORTED:
            self.refused = True
            return False
        return (
            enabled
            and module.training
            and torch.is_grad_enabled()
            and out.requires_grad
            and layer.adapter.trainable
        )

    def wrap(self, layer: KFACLayer, x: Tensor, out: Tensor) -> Tensor:
        """The output to hand on: ``out`` through :class:`_Statistics` (as it
        is where the sinks are on another device: see :meth:`follow`)."""
        return self.wrap_parts([(layer, None)], x, out)

    def wrap_parts(self, parts: Parts, x: Tensor, out: Tensor) -> Tensor:
        """:meth:`wrap` for one call that feeds several layers, each through
        its own columns of ``out`` (their input terms are formed once)."""
        parts = [(la, cols) for la, cols in parts if self._sinks[la.name].device == out.device]
        if not parts:
            return out
        sinks = [leaf for la, _ in parts for leaf in self._sinks[la.name].leaves()]
        return _Statistics.apply(out, x.detach(), self, parts, *sinks)

    # -- in the backward graph -------------------------------------------------
    def terms(
        self,
        layer: KFACLayer,
        x: Tensor,
        g: Tensor,
        memo: TermMemo | None = None,
    ) -> tuple[list[Tensor], Tensor]:
        """The call's term for every sink and its counts (traced: no host
        reads); ``memo`` shares input terms among layers fed by one call."""
        adapter = layer.adapter
        g = g.detach()
        batch = adapter.batch_size(x)
        positions = adapter.grad_output_rows(g).shape[1]
        items = 1.0 if self.loss_average is LossAverage.ITEMS else None
        m = grad_multiplier(self.loss_average, batch, positions, self.loss_divisor, items)
        scale = m * m
        terms: list[Tensor] = []
        counts: list[float] = []
        for stat in layer.statistics:
            if stat.source is FactorSource.INPUT:
                assert stat.factor is not None
                spec = layer.factors[stat.factor]
                key = input_term_key(layer, spec)
                if memo is not None and key in memo:  # a copy: each sink owns its gradient
                    term, rows = memo[key][0].clone(), memo[key][1]
                else:
                    term, rows = adapter.factor_term(spec, x, layer.factor_dtype, 1.0)
                    if memo is not None:
                        memo[key] = (term, rows)
                counts.append(rows)
            elif stat.source is FactorSource.OUTPUT_GRAD:
                assert stat.factor is not None
                spec = layer.factors[stat.factor]
                term = adapter.factor_term(spec, g, layer.factor_dtype, scale)[0]
                counts.append(float(batch))
            elif stat.source is FactorSource.JOINT:
                assert self.method is not None
                joint = joint_term(self.method, layer, stat, x, g, scale)
                if joint is None:  # nothing to form yet (no eigenbasis): counted as nothing
                    term = torch.zeros(stat.shape, dtype=layer.dtype_of(stat), device=g.device)
                    counts.append(0.0)
                else:
                    term = joint
                    counts.append(float(batch))
            else:
                counts.append(0.0)
                continue
            terms.append(term)
        counts.append(1.0)
        return terms, torch.tensor(counts, dtype=COUNT_DTYPE, device=g.device)

    # -- at step() ---------------------------------------------------------------
    def collect(self, layers: list[KFACLayer], correction: Tensor | float) -> None:
        """Move what the sinks accumulated into the layers' batch statistics.

        ``correction`` multiplies the output-gradient and joint terms: the
        ``m²`` the graph left out (``loss_items²``, ``1/loss_scale²``)."""
        for layer in layers:
            sinks = self._sinks.get(layer.name)
            if sinks is None or sinks.count.grad is None:
                continue
            counts = sinks.count.grad.tolist()  # one host read per layer, factor steps only
            calls, passes = counts[-1], max(sinks.passes, 1)
            stats = layer.batch
            for i, (stat, sink) in enumerate(zip(layer.statistics, sinks.terms, strict=True)):
                if sink is None or sink.grad is None or counts[i] == 0:
                    continue
                term = sink.grad
                if stat.source is FactorSource.INPUT:
                    stats.counts[i] += counts[i]
                else:
                    if not (isinstance(correction, float) and correction == 1.0):
                        term = term * correction
                    # data points of each pass once: the calls of a pass share them
                    stats.counts[i] += counts[i] * passes / calls
                stats.add(i, term)
            stats.calls += int(calls)
            stats.passes += passes
            sinks.clear()

    def has_data(self) -> bool:
        return any(s.count.grad is not None for s in self._sinks.values())


def joint_term(
    method: CurvatureMethod,
    layer: KFACLayer,
    stat: StatisticSpec,
    x: Tensor,
    g: Tensor,
    scale: float | Tensor,
) -> Tensor | None:
    """One call's term of a joint statistic, by the method (None: nothing yet)."""
    adapter = layer.adapter
    return method.joint_term(
        stat,
        layer,
        adapter.a_rows(x),
        adapter.grad_output_rows(g),
        scale,
        layer.dtype_of(stat),
    )
