"""Per-example output gradients of a layer output that is broadcast over the batch.

A position embedding called with ids of shape ``[1, T]`` — what Hugging Face
models build when no ``position_ids`` are passed — returns ``[1, T, d]``,
which the model adds to the ``[N, T, d]`` token embeddings.  Autograd sums
the gradient over the broadcast, so a hook on that output sees ``Σ_n g_n``,
where K-FAC's G needs every ``g_n``.  They exist, one step later: the
gradient of the operand once expanded, ``out.expand(N, T, d)``, is
``[N, T, d]``, and expand's backward sums it to the very same ``Σ_n g_n``.

So the forward hook of such a layer returns its output wrapped in
:class:`BroadcastOutput`, a tensor subclass that, in the first elementwise
operation that broadcasts it over a larger leading dimension (``+``, ``-``,
``*``, in place or not, as a method, operator or ``torch`` function),
replaces itself by that expansion and hands kaisa the call it stands for:
``(ids.expand(N, T), out.expand(N, T, d))``, N examples, exact.  Operations
that keep its values (``.to``, ``.contiguous``, dtype casts) pass the
wrapper on, and queries (shape, dtype, printing) or uses without autograd
capture nothing; any other use hands kaisa an alias of the output (the
batch-summed gradient of that use only, which ``step()`` reports as one
data point per pass).  Each use is one call, as for a module called twice.
Every operation computes on plain tensors, so results are plain tensors and
autograd sees the graph it would without kaisa, plus an expand or a view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["BroadcastOutput", "wrap_broadcast"]

#: ``observe(x, output)``: capture one call of the layer
Observe = Callable[[Tensor, Tensor], None]

_BROADCASTING = frozenset(
    {
        torch.add,
        torch.sub,
        torch.mul,
        Tensor.add,
        Tensor.sub,
        Tensor.mul,
        Tensor.__add__,
        Tensor.__radd__,
        Tensor.__iadd__,
        Tensor.__sub__,
        Tensor.__rsub__,
        Tensor.__isub__,
        Tensor.__mul__,
        Tensor.__rmul__,
        Tensor.__imul__,
        Tensor.add_,
        Tensor.sub_,
        Tensor.mul_,
    }
)
_IN_PLACE = frozenset(
    {Tensor.__iadd__, Tensor.__isub__, Tensor.__imul__, Tensor.add_, Tensor.sub_, Tensor.mul_}
)
_KEEPS_VALUES = frozenset(
    {
        Tensor.to,
        Tensor.contiguous,
        Tensor.type,
        Tensor.float,
        Tensor.half,
        Tensor.bfloat16,
        Tensor.double,
    }
)


_QUERIES = frozenset(
    {
        Tensor.size,
        Tensor.dim,
        Tensor.numel,
        Tensor.stride,
        Tensor.element_size,
        Tensor.is_contiguous,
        Tensor.data_ptr,
        Tensor.__len__,
        Tensor.__repr__,
        Tensor.__format__,
    }
)


class _Call:
    """One forward call of the layer, not yet handed to kaisa."""

    def __init__(self, x: Tensor, observe: Observe) -> None:
        self.x = x
        self.observe = observe


def _is_query(func: Callable[..., Any]) -> bool:
    """A shape, dtype, device or printout: nothing of the values flows on."""
    return func in _QUERIES or getattr(func, "__name__", "") == "__get__"


class BroadcastOutput(Tensor):
    """A layer output of batch size 1 that expands itself where it is broadcast."""

    _kaisa_plain: Tensor
    _kaisa_call: _Call

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        wrapped = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, BroadcastOutput)]
        stand_in = {id(w): w._kaisa_plain for w in wrapped}
        if _is_query(func) or not torch.is_grad_enabled():
            return _call(func, args, kwargs, stand_in)
        if func in _KEEPS_VALUES and len(wrapped) == 1:
            result = _call(func, args, kwargs, stand_in)
            if isinstance(result, Tensor):
                return wrap_broadcast(result, wrapped[0]._kaisa_call)
            return result
        uses = []
        for w in wrapped:
            plain, call = w._kaisa_plain, w._kaisa_call
            batch = _broadcast_batch(w, func, args) if len(wrapped) == 1 else 1
            if batch > 1:  # the per-example gradients arrive at the expansion
                use = plain.expand(batch, *plain.shape[1:])
                x = call.x.expand(batch, *call.x.shape[1:])
            else:  # an alias of its own gets this use's gradient only
                use, x = plain.view_as(plain), call.x
            stand_in[id(w)] = use
            uses.append((call, x, use))
        result = _call(func, args, kwargs, stand_in)
        if any(isinstance(r, Tensor) and r.requires_grad for r in tree_flatten(result)[0]):
            for call, x, use in uses:
                call.observe(x, use)
        return result


def _call(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    stand_in: dict[int, Tensor],
) -> Any:
    """``func`` on plain tensors: each wrapper replaced by its stand-in."""
    args, kwargs = tree_map(
        lambda a: stand_in[id(a)] if isinstance(a, BroadcastOutput) else a, (args, kwargs)
    )
    return func(*args, **kwargs)


def _broadcast_batch(w: BroadcastOutput, func: Callable[..., Any], args: tuple[Any, ...]) -> int:
    """The leading size an elementwise ``func`` broadcasts ``w`` to (1: none)."""
    plain = w._kaisa_plain
    if func not in _BROADCASTING or len(args) < 2 or (func in _IN_PLACE and args[0] is w):
        return 1
    others = [a for a in args[:2] if isinstance(a, Tensor) and a is not w]
    if len(others) != 1 or plain.dim() == 0 or plain.shape[0] != 1:
        return 1
    try:
        shape = torch.broadcast_shapes(plain.shape, others[0].shape)
    except RuntimeError:
        return 1
    return int(shape[0]) if len(shape) == plain.dim() else 1


def wrap_broadcast(output: Tensor, call: _Call | tuple[Tensor, Observe]) -> BroadcastOutput:
    """``output`` as a :class:`BroadcastOutput` standing for ``call``: ``(x, observe)``."""
    if isinstance(call, tuple):
        call = _Call(*call)
    wrapped = output.as_subclass(BroadcastOutput)
    wrapped._kaisa_plain = output
    wrapped._kaisa_call = call
    return wrapped
