"""Hooks that capture layer inputs and output gradients.

* A forward hook on each registered module sees its input and registers a
  *tensor* hook on its output, which fires with the gradient w.r.t. that
  output.  Unlike ``register_full_backward_hook`` this works on the first
  layer and when an in-place activation follows the layer.
* A pass (one micro-batch) is identified by the forward pass of the root
  model (a forward pre-hook numbers them) *and* the backward pass that
  delivers the gradient, so gradient accumulation is normalised correctly
  whether micro-batches are separate backward passes, separate forwards of
  one summed loss, or forwards of a submodule the root never sees (Lightning
  calls ``self.net(x)`` inside ``training_step``).

A forward call commits nothing until its output gradient arrives: its input
statistics wait in the tensor hook.  So a training-mode forward that is
never followed by a backward adds nothing (it is counted, and reported at
``step()`` with a pointer to ``paused()``), and a forward that activation
checkpointing recomputes is counted once: reentrant checkpointing runs the
original forward without grad and backpropagates through the recomputation;
the non-reentrant kind backpropagates through the original forward, and its
recomputation is not captured at all (no hook work is done twice).

An output gradient counts only in a backward that accumulates into the
layer's parameters (:func:`_updates_gradients`): an input gradient taken
with ``torch.autograd.grad`` through the same forward (a gradient penalty, a
saliency map) is of another quantity than the gradient kaisa preconditions.

Inside a compiled region (``torch.compile``) the forward hook hands the call
to :mod:`kaisa.step.capture.graph` instead, whose statistics the graph forms
itself: nothing here is traced but that one branch.

Hooks are small picklable objects: a deep copy (or pickle) of the model
carries inert hooks, so a copied model (an EMA or teacher) never captures
into this preconditioner, and a model holding them can still be copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kaisa.config import LossAverage
from kaisa.layers.base import LayerAdapter
from kaisa.layers.state import GroupKey, KFACLayer
from kaisa.methods.base import CurvatureMethod
from kaisa.step.capture import terms
from kaisa.step.capture.attention import capture_functional
from kaisa.step.capture.broadcast import wrap_broadcast
from kaisa.step.capture.graph import GraphCapture
from kaisa.step.capture.hooks import (
    ModuleHook,
    TermMemo,
    _discarded_recomputation,
    _graph_task,
    _in_backward,
    _updates_gradients,
    first_tensor,
)
from kaisa.step.capture.normalise import LossNormalisation, ScaleGetter
from kaisa.step.profile import CAPTURE, StepProfile

__all__ = ["Capture"]


class Capture:
    """Owns every hook kaisa registers; :meth:`remove` takes them all off,
    :meth:`suspend` and :meth:`resume` take its own off and put them back.

    Args:
        model: the root module (forward passes are counted on it).
        layers: the registered layers.
        loss_average: what the loss was averaged over (sets ``ĝ = m·g``).
        accumulation_steps: micro-batches per optimizer step.
        loss_divisor: what each micro-batch's loss was divided by (``None``:
            ``accumulation_steps``; 1 where the gradients are divided after
            backward instead, as pipelining schedules do).
        in_hook: compute the statistics inside the hooks (no activations kept)
            or keep the raw tensors until :meth:`flush`.
        loss_scale: returns the current loss scale of a grad scaler (or None).
        method: the curvature method, whose joint statistics (if it declares
            any) it forms (None: the layers' factors only).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[KFACLayer],
        *,
        loss_average: LossAverage,
        accumulation_steps: int,
        in_hook: bool,
        loss_scale: ScaleGetter | None = None,
        loss_divisor: int | None = None,
        method: CurvatureMethod | None = None,
    ) -> None:
        self.method = method
        self.accumulation_steps = accumulation_steps
        #: each micro-batch's loss is divided by ``accumulation_steps`` (no divisor given)
        self._divisor_follows = loss_divisor is None
        divisor = accumulation_steps if loss_divisor is None else loss_divisor
        #: ``m`` of ``ĝ = m·g`` per call (kaisa.step.capture.normalise)
        self.normalisation = LossNormalisation(loss_average, divisor, loss_scale)
        self.in_hook = in_hook
        self.enabled = True
        #: the positions each factor reads (one sampler for every layer; None: all)
        self.positions = next(
            (la.adapter.positions for la in layers if la.adapter.positions is not None), None
        )
        self.pass_id = 0
        #: called with a layer once all of its passes for this step are in
        self.on_layer_complete: Callable[[KFACLayer], None] | None = None
        self.layers = layers
        #: the path of calls inside a compiled region (kaisa.step.capture.graph)
        self.graph = GraphCapture(
            layers, loss_average=loss_average, loss_divisor=divisor, method=method
        )
        #: the phases' wall times, while attached (:mod:`kaisa.step.profile`)
        self.profile: StepProfile | None = None
        self._model = model
        #: the hooks registered here (taken off and put back by :meth:`suspend`)
        self._own: list[RemovableHandle] = self._register()
        #: hooks an engine registered (:meth:`adopt`)
        self._adopted: list[RemovableHandle] = []
        self._removed = False

    def _register(self) -> list[RemovableHandle]:
        """Put capture's hooks on the model: a pass counter on the root, a
        forward hook per layer (the functional ones' on their module)."""
        model = self._model
        handles = [model.register_forward_pre_hook(ModuleHook(self._count_pass, model))]
        functional: list[KFACLayer] = []
        for layer in self.layers:
            if layer.adapter.captured_by_engine:
                continue  # the engine calls observe() itself (ModelParallelLayers.connect)
            if not layer.adapter.captured_by_module_hooks:
                functional.append(layer)
                continue
            module = layer.adapter.module
            handles.append(
                module.register_forward_hook(ModuleHook(self._forward_hook(layer), module))
            )
        if functional:
            handles.extend(capture_functional(self, functional))
        return handles

    def begin_step(self, step: int, factor_step: bool) -> None:
        """Capture the calls of ``step`` if it is a factor step; its positions
        are drawn for that step (:mod:`kaisa.core.positions`; set on factor
        steps only: on a GPU each new step is a write to the device)."""
        self.enabled = factor_step
        if self.positions is not None and factor_step:
            self.positions.step = step

    @property
    def root(self) -> nn.Module:
        """The model the pass counter is on (its modules are the model's)."""
        return self._model

    def set_accumulation_steps(self, steps: int) -> None:
        """Micro-batches of the coming step (and what each one's loss is
        divided by, unless an engine said otherwise).  Between steps only:
        the passes already captured were scaled by the old count."""
        if any(la.batch.started or la.pending.calls for la in self.layers) or self.graph.has_data():
            raise RuntimeError(
                "kaisa: accumulation_steps can change between steps only (after step(), "
                "before the next step's first forward): this step's passes were read with "
                f"accumulation_steps={self.accumulation_steps}"
            )
        self.accumulation_steps = steps
        if self._divisor_follows:
            self.normalisation.loss_divisor = steps
            self.graph.loss_divisor = steps

    # -- hooks -------------------------------------------------------------
    def _count_pass(self, module: nn.Module, inputs: Any) -> None:
        if not self.enabled:
            return  # a non-factor step: nothing is captured (asked first: every forward)
        if torch.compiler.is_compiling():
            return  # compiled calls count their passes on their sinks
        if module.training and torch.is_grad_enabled():
            self.pass_id += 1

    def _forward_hook(self, layer: KFACLayer) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
            if not self.enabled:
                return None  # a non-factor step: nothing is captured (asked first)
            x = first_tensor(inputs)
            out = layer.adapter.output_tensor(output)
            if x is None or out is None:
                return None
            if torch.compiler.is_compiling():
                if out is output and self.graph.accepts(layer, module, out, self.enabled):
                    return self.graph.wrap(layer, x, out)
                return None
            if out is output and self._broadcast(layer, module, x, out):
                # observed where the output meets the batch (kaisa.step.capture.broadcast)
                return wrap_broadcast(out, (x, lambda xx, oo: self.observe(layer, module, xx, oo)))
            self.observe(layer, module, x, out)
            return None

        return hook

    def _broadcast(self, layer: KFACLayer, module: nn.Module, x: Tensor, out: Tensor) -> bool:
        """Whether the output may be broadcast over a batch it does not have:
        one row of ids (position ids ``[1, T]``), or ids without a batch
        dimension (``[T]``), of a layer that allows it."""
        one_row = x.dim() >= 2 and x.shape[0] == 1 and out.dim() >= 1 and out.shape[0] == 1
        unbatched = x.dim() == 1 and out.dim() == 2
        return (
            layer.adapter.broadcast_over_batch
            and (one_row or unbatched)
            and not hasattr(out, "placements")
            and self.accepts(layer.adapter, module, out)
        )

    def wants(self, module: nn.Module) -> bool:
        """Whether a forward of ``module`` now is captured at all."""
        return self.enabled and module.training and torch.is_grad_enabled()

    def accepts(self, adapter: LayerAdapter, module: nn.Module, output: Tensor) -> bool:
        """Whether :meth:`observe` would capture this call: the same answer on
        every rank that runs the same forward, so ranks that only help a
        layer's owner (tensor parallelism) can join its collectives exactly
        when it captures."""
        if not self.wants(module) or not output.requires_grad or not adapter.trainable:
            return False
        return not (_in_backward() and _discarded_recomputation())

    def adopt(self, handles: list[RemovableHandle]) -> None:
        """Take hooks registered elsewhere (by an engine), so :meth:`remove` removes them."""
        self._adopted.extend(handles)

    def observe(
        self,
        layer: KFACLayer,
        module: nn.Module,
        x: Tensor,
        output: Tensor,
        grad_view: Callable[[Tensor], Tensor] | None = None,
        memo: TermMemo | None = None,
    ) -> None:
        """One call of ``layer``: its input ``x`` (in the adapter's input shape)
        and the ``output`` whose gradient completes it; ``grad_view`` maps that
        gradient to the adapter's shape (a functional capture's slice);
        ``memo`` lets layers called on the same ``x`` share its input terms."""
        if not self.accepts(layer.adapter, module, output):
            if self.enabled and not module.training and torch.is_grad_enabled():
                layer.eval_forward = True  # said at step() if it is all the layer saw
            return
        layer.eval_forward = False
        if x.numel() == 0 or output.numel() == 0:
            return  # no data points (a rank's empty share of the batch): nothing to add
        if hasattr(x, "placements") and not layer.adapter.sees_dtensors:
            raise RuntimeError(
                f"kaisa: layer {layer.name!r} received a DTensor input: the model was "
                "parallelised after KFACPreconditioner was built. Construct the preconditioner "
                "after parallelize_module"
            )
        profile = self.profile
        since = profile.start() if profile is not None else 0.0
        recomputed = _in_backward()
        batch = layer.adapter.batch_size(x)
        group = layer.batch.note_forward(batch, self.pass_id, _graph_task() if recomputed else None)
        x = x.detach()
        inputs = terms.input_terms(layer, x, memo, profile) if self.in_hook else []
        output.register_hook(
            self._grad_hook(layer, x, inputs, (group, batch), recomputed, grad_view)
        )
        if profile is not None:
            profile.stop(CAPTURE, since)

    def _grad_hook(
        self,
        layer: KFACLayer,
        x: Tensor,
        inputs: list[tuple[int, Tensor, float]],
        call: tuple[GroupKey, int],
        recomputed: bool,
        grad_view: Callable[[Tensor], Tensor] | None,
    ) -> Callable[[Tensor], None]:
        pass_id = self.pass_id
        keep = None if self.in_hook else x
        joint_x = x if self.in_hook and terms.needs_input(layer) else None

        def hook(grad: Tensor) -> None:
            if not _updates_gradients(layer.adapter.parameters()):
                return  # not this layer's training gradient: the forward stays pending
            profile = self.profile
            since = profile.start() if profile is not None else 0.0
            key = (pass_id, _graph_task())
            g = grad.detach() if grad_view is None else grad_view(grad.detach())
            positions = layer.adapter.grad_output_rows(g).shape[1]
            layer.batch.note_backward(recomputed)
            batch = layer.batch.batch_of(*call)  # (its forward group, its own batch)
            multiplier = self.normalisation.multiplier(batch, positions)
            if keep is not None:
                layer.pending.calls.append((keep, g, batch, multiplier, key))
            else:
                terms.commit_call(
                    layer, inputs, g, batch, multiplier, key, joint_x, self.method, profile
                )
                complete = layer.batch.complete(self.accumulation_steps)
                if complete and self.on_layer_complete is not None:
                    self.on_layer_complete(layer)
            if profile is not None:
                profile.stop(CAPTURE, since)

        return hook

    def collect_compiled(self) -> None:
        """Take in what compiled calls accumulated (:meth:`GraphCapture.collect`),
        with the loss items and loss scale the graph leaves out."""
        self.graph.follow(self.layers)
        if not self.graph.has_data():
            return
        self.graph.collect(self.layers, self.normalisation.compiled_correction())

    # -- deferred path -------------------------------------------------------
    def flush(self, layer: KFACLayer) -> None:
        """Turn raw captures kept by ``in_hook=False`` into statistics."""
        for x, g, batch, multiplier, pass_id in layer.pending.calls:
            terms.commit_call(
                layer,
                terms.input_terms(layer, x),
                g,
                batch,
                multiplier,
                pass_id,
                x,
                self.method,
            )
        layer.pending.calls.clear()

    def remove(self) -> None:
        for handle in (*self._own, *self._adopted):
            handle.remove()
        self._own.clear()
        self._adopted.clear()
        self._removed = True

    def suspend(self) -> None:
        """Take the hooks registered here off the model (an engine's stay):
        the forward runs as if kaisa were not attached, and captures nothing."""
        for handle in self._own:
            handle.remove()
        self._own.clear()

    def resume(self) -> None:
        """Put the hooks :meth:`suspend` took off back (nothing after :meth:`remove`)."""
        if not self._own and not self._removed:
            self._own = self._register()

    @property
    def suspended(self) -> bool:
        return not self._own and not self._removed

    @property
    def active(self) -> bool:
        return not self._removed
