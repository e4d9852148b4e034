"""Per-example output gradients of a layer output that is broadcast over the batch.

A position embedding called with ids of shape ``[1, T]`` — what Hugging Face
models build when no ``position_ids`` are passed — returns ``[1, T, d]``,
which the model adds to the ``[N, T, d]`` token embeddings; called with
``[T]`` (nanoGPT's ``wpe(arange(T))``) it returns ``[T, d]``, which the
addition broadcasts over a new leading dimension.  Autograd sums
the gradient over the broadcast, so a hook on that output sees ``Σ_n g_n``,
where K-FAC's G needs every ``g_n``.  They exist, one step later: the
gradient of the operand once expanded, ``out.expand(N, T, d)``, is
``[N, T, d]``, and expand's backward sums it to the very same ``Σ_n g_n``.

So the forward hook of such a layer returns its output wrapped in
:class:`BroadcastOutput`, a tensor subclass that, in the first elementwise
operation that broadcasts it over a larger leading dimension (``+``, ``-``,
``*``, in place or not, as a method, operator or ``torch`` function),
replaces itself by that expansion and hands kaisa the call it stands for:
``(ids.expand(N, T), out.expand(N, T, d))``, N examples, exact (from
``[T]`` ids only a broadcast that adds the leading dimension is one over
the batch).  Operations
that keep its values (``.to``, ``.contiguous``, dtype casts) pass the
wrapper on, and queries (shape, dtype, printing) or uses without autograd
capture nothing; any other use hands kaisa an alias of the output (its
batch-summed gradient, which ``step()`` reports as one data point per pass
where the rest of the model sees more).  The uses that broadcast it to the
same batch share one expansion, and the other uses one alias, so each reads
the sum of its uses' gradients — the output's whole gradient, as without
the wrapper, when the output feeds several branches (a residual, a genuine
batch of one sequence); only an expansion and the alias, whose gradients
cannot be added per example, stay two calls, as for a module called twice.
A use that changes it in place gets an alias of its own, and the uses
after it start afresh.  Hooks on the output (``register_hook``,
``retain_grad``) go to the output itself, which receives the whole gradient.
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


#: asked of the output itself, which autograd gives the sum of every use's gradient
_ON_THE_OUTPUT = frozenset({Tensor.register_hook, Tensor.retain_grad})

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
        #: ids without a batch dimension (``[T]``): a broadcast prepends it
        self.prepend = x.dim() == 1


class _Uses:
    """A wrapped output's stand-ins so far: one per batch it was broadcast to
    (1: the alias of the uses that do not broadcast it), each with the input
    it stands for, and which of them kaisa has been handed."""

    def __init__(self) -> None:
        self.stand_ins: dict[int, tuple[Tensor, Tensor]] = {}
        self.observed: set[int] = set()

    def stand_in(self, plain: Tensor, call: _Call, batch: int) -> tuple[Tensor, Tensor]:
        """The (output, input) that a use broadcasting to ``batch`` computes with."""
        held = self.stand_ins.get(batch)
        x = call.x
        if held is None:
            if batch > 1 and call.prepend:  # [T] ids: the batch dimension is added
                held = plain.expand(batch, *plain.shape), x.expand(batch, *x.shape)
            elif batch > 1:  # the per-example gradients arrive at the expansion
                held = plain.expand(batch, *plain.shape[1:]), x.expand(batch, *x.shape[1:])
            else:
                held = plain.view_as(plain), x
            self.stand_ins[batch] = held
        return held


def _is_query(func: Callable[..., Any]) -> bool:
    """A shape, dtype, device or printout: nothing of the values flows on."""
    return func in _QUERIES or getattr(func, "__name__", "") == "__get__"


class BroadcastOutput(Tensor):
    """A layer output of batch size 1 that expands itself where it is broadcast."""

    _kaisa_plain: Tensor
    _kaisa_call: _Call
    _kaisa_uses: _Uses

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
        if _is_query(func) or func in _ON_THE_OUTPUT or not torch.is_grad_enabled():
            return _call(func, args, kwargs, stand_in)
        if func in _KEEPS_VALUES and len(wrapped) == 1:
            result = _call(func, args, kwargs, stand_in)
            if isinstance(result, Tensor):
                return wrap_broadcast(result, wrapped[0]._kaisa_call)
            return result
        uses = []
        for w in wrapped:
            plain, call = w._kaisa_plain, w._kaisa_call
            if func in _IN_PLACE and args[0] is w:  # changed in place: an alias of its own
                use, x = _Uses().stand_in(plain, call, 1)
                w._kaisa_uses = _Uses()  # the uses after it start afresh
                observed = None
            else:
                batch = _broadcast_batch(w, func, args) if len(wrapped) == 1 else 1
                use, x = w._kaisa_uses.stand_in(plain, call, batch)
                observed = w._kaisa_uses.observed
            stand_in[id(w)] = use
            uses.append((call, x, use, observed))
        result = _call(func, args, kwargs, stand_in)
        if any(isinstance(r, Tensor) and r.requires_grad for r in tree_flatten(result)[0]):
            for call, x, use, observed in uses:
                if observed is None or id(use) not in observed:
                    call.observe(x, use)
                    if observed is not None:
                        observed.add(id(use))
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
    plain, prepend = w._kaisa_plain, w._kaisa_call.prepend
    if func not in _BROADCASTING or len(args) < 2 or (func in _IN_PLACE and args[0] is w):
        return 1
    others = [a for a in args[:2] if isinstance(a, Tensor) and a is not w]
    if len(others) != 1 or plain.dim() == 0 or (not prepend and plain.shape[0] != 1):
        return 1
    try:
        shape = torch.broadcast_shapes(plain.shape, others[0].shape)
    except RuntimeError:
        return 1
    if prepend:  # [T, d]: the batch is a dimension the broadcast adds, and only one
        return int(shape[0]) if len(shape) == plain.dim() + 1 else 1
    return int(shape[0]) if len(shape) == plain.dim() else 1


def wrap_broadcast(output: Tensor, call: _Call | tuple[Tensor, Observe]) -> BroadcastOutput:
    """``output`` as a :class:`BroadcastOutput` standing for ``call``: ``(x, observe)``."""
    if isinstance(call, tuple):
        call = _Call(*call)
    wrapped = output.as_subclass(BroadcastOutput)
    wrapped._kaisa_plain = output
    wrapped._kaisa_call = call
    wrapped._kaisa_uses = _Uses()
    return wrapped
