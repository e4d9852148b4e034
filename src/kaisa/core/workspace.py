"""Reused buffers for the temporaries of the preconditioning step (CPU only).

Every step, each layer needs three gradient-sized temporaries: the gradient
matrix with its bias column (``[∇W | ∇b]``, a ``cat``) and the two
intermediate products of ``G⁻¹ ∇ A⁻¹`` or ``Q_G[(Q_Gᵀ ∇ Q_A)/D]Q_Aᵀ``.  On
CPU a fresh allocation of that size is served by the C allocator from memory
it has just handed back to the system, so every page is faulted in again:
about 700 page faults and 1 ms per step on the MLP 784-512-512-10
(``docs/reports/step-cost.md``), 10% of its preconditioning products.  On CUDA the
caching allocator already reuses blocks, and holding buffers would only cost
memory, so there is no workspace there.

Where a layer's gradient matrix is the plain concatenation of its own
parameters' gradients, the products read those and write ``V`` over them
(:meth:`kaisa.methods.base.CurvatureMethod.apply_blocks`): no ``[∇W | ∇b]``
is assembled, and the gradient buffer holds instead the copy of ``∇`` that
the KL clip's ``⟨V, ∇⟩`` reads afterwards (the inverse method; the eigen
method forms that product in its eigenbasis and keeps nothing).  The three
buffers are allocated together all the same (:meth:`Workspace.prepare`), so
the memory held does not depend on which path a layer takes.

Layers whose gradient matrix is under :data:`MIN_BYTES` allocate as
before; a model with no larger layer (the digits models) keeps the path
that holds every ``V`` until ``ν`` is known, which costs less Python there.
The buffers are shared by the larger layers — each layer's preconditioned
gradient is written into ``.grad`` before the next layer runs
(:mod:`kaisa.step.apply`) — so they hold three times the largest gradient matrix,
not the model: this is ``memory_usage()["workspace"]``, and
:mod:`kaisa.planner.forecast` predicts it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "MAX_OPERAND_NUMEL",
    "MIN_BYTES",
    "Alternating",
    "Workspace",
    "products_into",
    "uses_workspace",
    "workspace_bytes",
]

#: the gradient copy (``[∇W | ∇b]``) and the two product buffers used in turn
_ROLES = ("gradient", "ping", "pong")


#: below this a gradient matrix is served from the C allocator's free lists
#: (glibc's smallest threshold for handing memory back to the system is 128
#: KiB), and a buffer would only add Python work to a small layer's step
MIN_BYTES = 128 * 1024

#: the largest operand (eigenbasis, inverse, divisor) a layer preconditioned
#: stacked with others of its shape may hold (:mod:`kaisa.step.batched`):
#: stacking copies the operands, which a large layer would pay for in memory
#: and not win back in launches; :mod:`kaisa.planner.forecast` counts the copies
MAX_OPERAND_NUMEL = 1 << 18


def uses_workspace(device: torch.device, numel: int, itemsize: int) -> bool:
    """Whether a layer's products reuse the workspace: where fresh
    allocations fault their pages in (CPU), not where a caching allocator
    reuses them (CUDA and other accelerators), and only for a gradient
    matrix large enough to be handed back to the system when freed."""
    return device.type == "cpu" and numel * itemsize >= MIN_BYTES


def workspace_bytes(largest: int, grad_itemsize: int, compute_itemsize: int) -> int:
    """Bytes a workspace holds for a largest gradient matrix of ``largest``
    entries: one gradient copy, two product buffers."""
    return largest * (grad_itemsize + 2 * compute_itemsize)


class Workspace:
    """Three flat buffers, each the size of the largest gradient matrix.

    Allocated all at once on first use, so the memory held is the same
    whichever layers take part in a step.  :meth:`take` hands out views; a
    view is valid until the next :meth:`take` of the same role.
    """

    def __init__(self, largest: int, device: torch.device) -> None:
        self.largest = largest
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    @classmethod
    def for_shapes(cls, shapes: Sequence[Sequence[int]], device: torch.device) -> Workspace:
        largest = max((int(torch.Size(s).numel()) for s in shapes), default=0)
        return cls(largest, device)

    def prepare(self, grad_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        """Allocate the three buffers for these dtypes (once)."""
        for role in _ROLES:
            dtype = grad_dtype if role == "gradient" else compute_dtype
            if (role, dtype) not in self._buffers:
                self._buffers[role, dtype] = torch.empty(
                    self.largest, dtype=dtype, device=self.device
                )

    def take(self, role: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """A ``shape`` view of buffer ``role`` (allocated if :meth:`prepare` was not)."""
        buf = self._buffers.get((role, dtype))
        if buf is None:
            buf = self._buffers[role, dtype] = torch.empty(
                self.largest, dtype=dtype, device=self.device
            )
        return buf[: int(torch.Size(shape).numel())].view(*shape)

    def keep(self, blocks: Sequence[Tensor]) -> list[Tensor]:
        """Copies of ``blocks`` side by side in the gradient buffer: the
        gradient the KL clip's ``⟨V, ∇⟩`` reads once ``V`` has been written
        over it (valid until the next :meth:`keep` or ``take("gradient")``)."""
        flat = self.take("gradient", (self.largest,), blocks[0].dtype)
        kept, start = [], 0
        for block in blocks:
            view = flat[start : start + block.numel()].view(block.shape)
            kept.append(view.copy_(block))
            start += block.numel()
        return kept

    def products(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The two product buffers, to be written in turn (never read and written at once)."""
        return self.take("ping", shape, dtype), self.take("pong", shape, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())


class _Fresh:
    """No buffers: every product allocates (see :func:`products_into`)."""

    @staticmethod
    def next() -> None:
        return None


_FRESH = _Fresh()


def products_into(work: Workspace | None, like: Tensor) -> Alternating | _Fresh:
    """Where the products of a gradient like ``like`` go."""
    return _FRESH if work is None else Alternating(work, like.shape, like.dtype)


class Alternating:
    """Where a method's successive products go: the two product buffers in
    turn (so no product reads the buffer it writes), or nowhere (``None``:
    a fresh tensor) without a workspace or for a gradient that is not a
    matrix."""

    def __init__(self, work: Workspace | None, shape: Sequence[int], dtype: torch.dtype) -> None:
        self._pair = work.products(shape, dtype) if work is not None and len(shape) == 2 else None
        self._next = 0

    def buffer(self) -> Tensor:
        """:meth:`next` where a workspace is known to serve the products."""
        out = self.next()
        assert out is not None, "no workspace buffers for these products"
        return out

    def next(self) -> Tensor | None:
        if self._pair is None:
            return None
        out = self._pair[self._next]
        self._next ^= 1
        return out
