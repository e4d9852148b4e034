"""Capture of layers that a module applies functionally: ``nn.MultiheadAttention``.

``F.multi_head_attention_forward`` projects q, k and v and the output with
``F.linear`` on the module's weights; no module hook sees those calls.
While a registered attention module runs forward (between its forward
pre-hook and its always-called forward hook), ``torch.nn.functional.linear``
— the name that function looks up — is replaced by a wrapper that calls the
original and, when the weight is one of that module's projections
(recognised by data pointer and shape, so the packed weight and the views
``split``/``chunk`` make of it are both found), hands the input and the
output to :meth:`kaisa.step.capture.calls.Capture.observe` in canonical shape.
Nothing else changes: the wrapper returns the original's result, every other
``F.linear`` call passes straight through, and the original is restored when
the last active attention module's forward ends (also on an exception).

Inside ``F.multi_head_attention_forward`` the projections see sequence-first
tensors ``[S, N, d]`` (batch-first inputs are transposed before, unbatched
ones unsqueezed), and the output projection's input is ``[L·N, E]`` in
``(L, N)`` order; both become ``[N, S, d]`` here.

Inside ``torch.compile`` nothing is run to be watched (dynamo keeps that
function as one node of the graph); the forward hook returns the output of
kaisa's own attention instead, whose projections the graph captures
(:mod:`kaisa.step.capture.attention_graph`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kaisa.layers.attention import ProjectionAdapter
from kaisa.layers.state import KFACLayer
from kaisa.step.capture.attention_graph import attention_forward, forward_arguments
from kaisa.step.capture.graph import GraphCapture, Parts
from kaisa.step.capture.hooks import ModuleHook, TermMemo

__all__ = ["Capture", "capture_functional"]


class Capture(Protocol):
    """What the attention capture asks of :class:`kaisa.step.capture.calls.Capture`
    (a protocol, so that the two modules do not import each other)."""

    enabled: bool
    graph: GraphCapture

    def wants(self, module: nn.Module) -> bool: ...

    def observe(
        self,
        layer: KFACLayer,
        module: nn.Module,
        x: Tensor,
        output: Tensor,
        grad_view: Callable[[Tensor], Tensor] | None = None,
        memo: TermMemo | None = None,
    ) -> None: ...


Route = tuple[KFACLayer, slice | None]

_ACTIVE: list[_AttentionCapture] = []
_ORIGINAL: list[Callable[..., Tensor]] = []


def _linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    out = _ORIGINAL[0](input, weight, bias)
    if torch.compiler.is_compiling():  # traced tensors have no data pointer
        return out
    key = (weight.data_ptr(), tuple(weight.shape))
    for active in reversed(_ACTIVE):
        routes = active.routes.get(key)
        if routes is not None:
            active.observe(routes, input, out)
            break
    return out


def _push(active: _AttentionCapture) -> None:
    if not _ACTIVE:
        _ORIGINAL[:] = [F.linear]
        F.linear = _linear
    _ACTIVE.append(active)


def _pop(active: _AttentionCapture) -> None:
    if active in _ACTIVE:
        _ACTIVE.remove(active)
        if not _ACTIVE:
            F.linear = _ORIGINAL[0]
            _ORIGINAL.clear()


class _AttentionCapture:
    """The projections of one ``nn.MultiheadAttention`` while it runs forward."""

    def __init__(self, capture: Capture, attention: nn.MultiheadAttention, layers: list[KFACLayer]):
        self.capture = capture
        self.attention = attention
        self.layers = {cast_adapter(la).role: la for la in layers}
        self.routes: dict[tuple[int, tuple[int, ...]], tuple[str, list[Route]]] = {}
        self.shape = (0, 0)

    def enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.capture.wants(module) or torch.compiler.is_compiling():
            return  # compiled: the forward hook captures (self._compiled)
        query = args[0] if args else kwargs.get("query")
        if not isinstance(query, Tensor):
            return
        mha = self.attention
        if query.dim() == 3:
            length, batch = query.shape[:2] if not mha.batch_first else query.shape[1::-1]
        else:
            length, batch = query.shape[0], 1
        self.shape = (int(length), int(batch))
        self.routes = self._routes()
        _push(self)

    def exit(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        _pop(self)
        if torch.compiler.is_compiling():
            return self._compiled(args, kwargs, output)
        return None

    def _compiled(self, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        """Inside a compiled region: the output of kaisa's own forward, whose
        projections the graph captures (:mod:`kaisa.step.capture.attention_graph`);
        the module's result becomes dead code the compiler removes."""
        if not isinstance(output, tuple) or not isinstance(output[0], Tensor):
            return None
        layers = {
            role: layer
            for role, layer in self.layers.items()
            if self.capture.graph.accepts(layer, self.attention, output[0], self.capture.enabled)
        }
        if not layers:
            return None
        graph = self.capture.graph

        def project(parts: Parts, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            out = F.linear(x, weight, bias)
            return graph.wrap_parts(parts, x, out) if parts else out

        return attention_forward(self.attention, layers, project, forward_arguments(args, kwargs))

    def _routes(self) -> dict[tuple[int, tuple[int, ...]], tuple[str, list[Route]]]:
        mha, e = self.attention, self.attention.embed_dim
        get = self.layers.get
        routes: dict[tuple[int, tuple[int, ...]], tuple[str, list[Route]]] = {}

        def add(weight: Tensor, offset_rows: int, rows: int, parts: list[Route]) -> None:
            if all(layer is not None for layer, _ in parts):
                ptr = weight.data_ptr() + offset_rows * weight.shape[1] * weight.element_size()
                routes[(ptr, (rows, int(weight.shape[1])))] = ("in", parts)

        if mha._qkv_same_embed_dim:
            w = mha.in_proj_weight
            q, k, v = get("q"), get("k"), get("v")
            add(w, 0, 3 * e, [(q, slice(0, e)), (k, slice(e, 2 * e)), (v, slice(2 * e, 3 * e))])  # type: ignore[list-item]
            add(w, e, 2 * e, [(k, slice(0, e)), (v, slice(e, 2 * e))])  # type: ignore[list-item]
            for i, layer in enumerate((q, k, v)):
                add(w, i * e, e, [(layer, None)])  # type: ignore[list-item]
        else:
            for role in ("q", "k", "v"):
                add(getattr(mha, f"{role}_proj_weight"), 0, e, [(get(role), None)])  # type: ignore[list-item]
        out = get("out")
        if out is not None:
            ow = mha.out_proj.weight
            routes[(ow.data_ptr(), tuple(ow.shape))] = ("out", [(out, None)])
        return routes

    def observe(self, route: tuple[str, list[Route]], x: Tensor, out: Tensor) -> None:
        kind, parts = route
        length, batch = self.shape
        if kind == "out":  # [L·N, E] in (L, N) order

            def canonical(t: Tensor) -> Tensor:
                return t.reshape(length, batch, t.shape[-1]).transpose(0, 1)

        else:  # [S, N, d]

            def canonical(t: Tensor) -> Tensor:
                return t.transpose(0, 1)

        rows = canonical(x)
        memo: TermMemo = {}  # q, k, v of one packed call share their input factor
        for layer, select in parts:
            self.capture.observe(layer, self.attention, rows, out, _sliced(canonical, select), memo)


def _sliced(
    canonical: Callable[[Tensor], Tensor], select: slice | None
) -> Callable[[Tensor], Tensor]:
    if select is None:
        return canonical
    return lambda g: canonical(g)[..., select]


def cast_adapter(layer: KFACLayer) -> ProjectionAdapter:
    adapter = layer.adapter
    assert isinstance(adapter, ProjectionAdapter)
    return adapter


def capture_functional(capture: Capture, layers: list[KFACLayer]) -> list[RemovableHandle]:
    """Hooks that capture ``layers`` (applied functionally by their module)."""
    by_module: dict[int, list[KFACLayer]] = {}
    for layer in layers:
        by_module.setdefault(id(cast_adapter(layer).attention), []).append(layer)
    handles: list[RemovableHandle] = []
    for group in by_module.values():
        attention = cast_adapter(group[0]).attention
        active = _AttentionCapture(capture, attention, group)
        handles.append(
            attention.register_forward_pre_hook(
                ModuleHook(active.enter, attention), with_kwargs=True
            )
        )
        handles.append(
            attention.register_forward_hook(
                ModuleHook(active.exit, attention), with_kwargs=True, always_call=True
            )
        )
    return handles
