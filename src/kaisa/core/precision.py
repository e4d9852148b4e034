"""Lower-precision operands for the preconditioning products (``precondition_dtype``).

The preconditioning products (``Q_Gᵀ ∇ Q_A``, the divide and back for the
eigen method; ``G⁻¹ ∇ A⁻¹`` for the inverse method) are dtype-generic: they
run in the dtype of the tensors they are handed.  To run them in bfloat16
while the stored eigenbases/inverses keep ``inv_dtype`` (so that what is
decomposed, broadcast and checkpointed does not change), a worker keeps a
cast copy of each second-order tensor.

Casting a ``d×d`` basis reads and writes all of it — next to a product with
a gradient of a few rows, a cost of the same order — so the copy is made
once per inverse update, not once per step: it
is cached and remade only when its source tensor is replaced (a new
decomposition, a broadcast received, a checkpoint loaded) or modified in
place (its version counter moved).  The cache holds its sources by weak
reference and drops a copy as soon as its source is freed, so it never keeps
memory alive that the layer's state has let go of; what it holds is counted
in ``memory_usage()["second_order"]`` (:meth:`CastCopies.nbytes`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["CastCopies"]


class _Entry:
    """A cast copy and the (weakly held) source it was made from, at its version."""

    __slots__ = ("copy", "source", "version")

    def __init__(self, source: weakref.ref[Tensor], version: int, copy: Tensor) -> None:
        self.source = source
        self.version = version
        self.copy = copy


class CastCopies:
    """Cast copies of a layer's second-order tensors in the precondition dtype.

    ``dtype=None`` means "the tensors' own dtype": :meth:`of` then returns the
    state itself and nothing is ever copied (the default, bit-identical to a
    preconditioner without the option).
    """

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self._entries: dict[str, _Entry] = {}

    def of(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` with every tensor in :attr:`dtype` (copies made only when stale)."""
        dtype = self.dtype
        if dtype is None or all(t.dtype == dtype for t in state.values()):
            return state
        out: dict[str, Tensor] = {}
        for key, tensor in state.items():
            if tensor.dtype == dtype:
                out[key] = tensor
                continue
            entry = self._entries.get(key)
            if entry is None or entry.source() is not tensor:
                entry = self._entries[key] = _Entry(
                    weakref.ref(tensor, self._forget(key)), tensor._version, tensor.to(dtype)
                )
            elif entry.version != tensor._version:
                # the same source changed in place (EKFAC's S folded on a factor
                # step): refresh the copy in place too, so that a recorded graph,
                # which holds the copy's address, reads the new values
                entry.copy.copy_(tensor)
                entry.version = tensor._version
            out[key] = entry.copy
        for key in [k for k in self._entries if k not in state]:
            del self._entries[key]
        return out

    def _forget(self, key: str) -> Callable[[weakref.ref[Tensor]], None]:
        """A weakref callback dropping ``key``'s copy when its source is freed
        (only if the entry still belongs to that source)."""
        entries = self._entries

        def forget(ref: weakref.ref[Tensor]) -> None:
            entry = entries.get(key)
            if entry is not None and entry.source is ref:
                del entries[key]

        return forget

    def nbytes(self) -> int:
        """Bytes held by the copies (their sources are counted by the layer)."""
        return sum(e.copy.numel() * e.copy.element_size() for e in self._entries.values())
