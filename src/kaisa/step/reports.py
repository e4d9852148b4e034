"""What the step says once about a layer's captured statistics.

Things a user can get wrong without an error, each warned about once (per
layer where it is a layer's) at a factor step, before the statistics are
reduced: forwards with no backward, an input broadcast over the batch that
kaisa cannot see through, training forwards run in eval mode, a bias frozen
or unfrozen after the preconditioner was built (or training under a frozen
weight), a registered module replaced in the model, and more passes than
``accumulation_steps`` under a loss averaged over the batch.
"""

from __future__ import annotations

from torch import nn

from kaisa.core.options import LossAverage
from kaisa.core.specs import FactorSource
from kaisa.engines.base import Engine
from kaisa.layers.base import trained
from kaisa.layers.state import KFACLayer
from kaisa.warn import warn_user

__all__ = ["StepReports"]


class StepReports:
    """Warns once per layer (the layers already told are remembered)."""

    def __init__(self) -> None:
        self._broadcast: set[str] = set()
        self._eval: set[str] = set()
        self._bias: set[str] = set()
        self._replaced: set[str] = set()
        self._passes = False

    def broadcast_inputs(self, layers: list[KFACLayer]) -> None:
        """A layer that saw fewer data points per pass than the rest of the
        model was fed one row broadcast over the batch (position ids of shape
        ``[1, T]``) in a way :mod:`kaisa.step.capture.broadcast` cannot see through (not an
        elementwise ``+``/``-``/``*`` with the batch): its G is that of the
        batch-summed gradient, not the per-example one.  Said once per layer."""
        per_pass = {}
        for la in layers:
            index = next(
                (i for i, s in enumerate(la.factors) if s.source is FactorSource.OUTPUT_GRAD), None
            )
            if index is not None and la.batch.passes:
                per_pass[la.name] = la.batch.counts[index] / la.batch.passes
        if not per_pass:
            return
        most = max(per_pass.values())
        for name, seen in per_pass.items():
            if seen == 1 < most and name not in self._broadcast:
                self._broadcast.add(name)
                warn_user(
                    f"kaisa: layer {name!r} saw {seen:g} data point(s) per pass where other "
                    f"layers saw {most:g}: its input is probably broadcast over the batch (e.g. "
                    "position ids of shape [1, T]) by an operation kaisa does not see through "
                    "(it does an elementwise +, - or * with the batch), so its G factor is that "
                    "of the batch-summed gradient, and changes with how the batch is split over "
                    "ranks. Pass per-example inputs (ids.expand(N, T)) or leave it out with "
                    "skip_layers",
                )

    def eval_forwards(self, layers: list[KFACLayer], engine: Engine) -> None:
        """A layer with a gradient whose forwards this step all ran in eval
        mode: kaisa captures training-mode forwards only, so its factors
        miss this step.  Said once per layer; an eval forward that is not
        backpropagated (a validation pass) is ignored without a word."""
        names = [
            la.name
            for la in layers
            if la.eval_forward
            and not la.batch.has_data
            and not la.pending.calls
            and la.name not in self._eval
            and engine.present(la.adapter)
        ]
        if not names:
            return
        self._eval.update(names)
        listed = ", ".join(repr(n) for n in names[:3])
        if len(names) > 3:
            listed += f" and {len(names) - 3} more"
        warn_user(
            f"kaisa: layer(s) {listed} have a gradient but their forward ran in eval mode "
            "(model.eval()): kaisa captures training-mode forwards only, so their factors "
            "were not updated this step (a layer never captured keeps its raw gradient). "
            "Call model.train() before training forwards (after an evaluation, say); to "
            "train without dropout, set its probability to 0 instead of calling eval()",
        )

    def changed_biases(self, layers: list[KFACLayer]) -> None:
        """A bias whose ``requires_grad`` changed since the preconditioner was
        built: the layer's block (with or without the bias's ones column) was
        fixed then.  A bias unfrozen since keeps its raw gradient; a bias
        frozen since gets no gradient, and its weight is preconditioned by
        the block that holds the bias (with a zero bias gradient), not the
        weight's own.  A bias that trains under a frozen weight (BitFit)
        keeps its raw gradient too: the layer is preconditioned on the steps
        its weight has a gradient.  Said once per layer."""
        alone: list[str] = []  # said in one warning: BitFit freezes every weight
        for la in layers:
            bias = la.adapter.bias
            if bias is None or la.name in self._bias:
                continue
            if trained(bias) and not la.adapter.weight.requires_grad:
                self._bias.add(la.name)
                alone.append(la.name)
                continue
            if trained(bias) == la.adapter.has_bias:
                continue
            self._bias.add(la.name)
            if la.adapter.has_bias:
                what = (
                    "was trained when KFACPreconditioner was built and is frozen now: it gets "
                    "no gradient, and the weight is preconditioned by the block that holds the "
                    "bias (its gradient taken as zero), not by the weight's own block"
                )
            else:
                what = (
                    "was frozen when KFACPreconditioner was built and requires grad now: its "
                    "gradient is left as computed (not preconditioned, not scaled by the KL clip)"
                )
            warn_user(
                f"kaisa: the bias of layer {la.name!r} {what}. Each layer's K-FAC block is "
                "fixed when the preconditioner is built: build it after freezing or unfreezing",
            )
        if alone:
            warn_user(
                f"kaisa: biases train while their layers' weights are frozen: {alone}. Their "
                "gradients are left as computed (not preconditioned, not scaled by the KL "
                "clip); K-FAC preconditions a layer on the steps its weight has a gradient "
                "(skip_layers leaves those layers to the optimizer without this note)",
            )

    def replaced_modules(self, layers: list[KFACLayer], root: nn.Module) -> None:
        """A registered module that is no longer part of the model (another
        module assigned in its place): its hooks never fire, and the new
        module is not preconditioned.  Asked on factor steps, of the layers
        that captured nothing, so a model whose layers all ran costs
        nothing.  Said once per layer."""
        idle = [
            la
            for la in layers
            if la.batch.calls == 0
            and not la.pending.calls
            and la.adapter.captured_by_module_hooks
            and la.name not in self._replaced
        ]
        if not idle:
            return
        present = {id(m) for m in root.modules()}
        for la in idle:
            if id(la.adapter.module) in present:
                continue
            self._replaced.add(la.name)
            warn_user(
                f"kaisa: layer {la.name!r} is no longer part of the model (a module was "
                "assigned in its place after KFACPreconditioner was built): the new module "
                "is not preconditioned. Build a new preconditioner on the changed model; "
                "load_state_dict(precond.state_dict()) carries the other layers' state",
            )

    def extra_passes(
        self, layers: list[KFACLayer], accumulation_steps: int, loss_average: LossAverage
    ) -> None:
        """More passes of the model before ``step()`` than ``accumulation_steps``
        under a loss averaged over the batch.  Each pass (a forward of the root
        model and a backward through it that reaches the parameters) is read as
        one micro-batch whose loss was averaged over its own examples
        and divided by ``accumulation_steps``.  That is right where each
        pass's loss is averaged over its own batch and summed (a model
        called once per time step) and wrong, by ``(passes/k)²`` in G, where
        several passes feed one loss averaged over all of them (two views
        of a batch, a contrastive pair) or micro-batches are accumulated by
        hand without the option.  kaisa cannot tell the two apart, so it says
        so once."""
        if self._passes or loss_average not in (LossAverage.BATCH, LossAverage.BATCH_AND_SEQUENCE):
            return
        passes = max((la.batch.passes for la in layers), default=0)
        if passes <= accumulation_steps:
            return
        self._passes = True
        warn_user(
            f"kaisa: {passes} training passes (forward and backward) of the model reached its "
            f"layers before step() with accumulation_steps={accumulation_steps}. kaisa reads "
            "each pass as one micro-batch whose loss was averaged over its own examples and "
            "divided by accumulation_steps: if these passes feed one loss averaged over all "
            "of them (two augmented views, a contrastive pair) or are micro-batches accumulated by "
            f"hand, pass accumulation_steps={passes} (G is otherwise "
            f"({passes}/{accumulation_steps})² too small). Passes whose losses are each "
            "averaged over their own batch and summed (a model called once per time step) are "
            "read right as they are",
        )

    def dropped_forwards(self, layers: list[KFACLayer]) -> None:
        dropped = {la.name: la.batch.pending_forwards for la in layers}
        dropped = {n: c for n, c in dropped.items() if c > 0}
        if dropped:
            names = ", ".join(f"{n!r} ({c})" for n, c in dropped.items())
            warn_user(
                f"kaisa: training-mode forward calls with no backward before step() were "
                f"ignored: {names}. Run forwards that are not followed by backward inside "
                "`with precond.paused():` (or under torch.no_grad() / model.eval())",
            )
