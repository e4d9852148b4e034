"""Undoing the loss's reduction in a captured output gradient: ``ĝ = m·g``.

A loss averaged over the batch (or the batch and the sequence, or a given
number of items), divided again over accumulated micro-batches and
multiplied by a ``GradScaler``'s scale, hands each layer a gradient that
is a fraction of the one K-FAC's ``G`` is defined by.  :class:`LossNormalisation`
holds what that fraction depends on and gives its inverse ``m`` per call;
the compiled path, whose graph cannot read the loss items or the scale at
trace time, gets the same factor as a correction of its sums
(:meth:`LossNormalisation.compiled_correction`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from kaisa.config import LossAverage, check_number, plain_number
from kaisa.core.statistics import grad_multiplier

__all__ = ["LossNormalisation", "ScaleGetter"]

#: returns the current loss scale of a grad scaler (None: no scale this step)
ScaleGetter = Callable[[], Tensor | float | None]


class LossNormalisation:
    """``m`` of ``ĝ = m·g``: the loss's average undone, the loss scale divided out.

    Args:
        loss_average: what the loss was averaged over.
        loss_divisor: what each micro-batch's loss was divided by.
        loss_scale: the grad scaler's current scale (None: no scaler).
    """

    def __init__(
        self, loss_average: LossAverage, loss_divisor: int, loss_scale: ScaleGetter | None
    ) -> None:
        self.loss_average = loss_average
        self.loss_divisor = loss_divisor
        self.loss_scale = loss_scale
        #: ``N`` of ``loss = Σ ℓ / N`` (``LossAverage.ITEMS``: ``precond.loss_items``)
        self.items: float | None = None

    def set_items(self, value: float | Tensor | None) -> None:
        """``precond.loss_items = value``: one positive finite number (a 1-element
        tensor is read as one), or None."""
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"loss_items must be one number; got a tensor of {value.numel()}")
            value = float(value.item())
        if value is not None:
            value = plain_number("loss_items", value)  # a numpy count, as a Trainer gives
            check_number("loss_items", value, low=0, low_open=True)
        self.items = None if value is None else float(value)

    def multiplier(self, batch: int, positions: int) -> float | Tensor:
        """``m`` of one call of ``batch`` examples and ``positions`` positions each."""
        m: float | Tensor = grad_multiplier(
            self.loss_average, batch, positions, self.loss_divisor, self.items
        )
        scale = self._scale()
        return m if scale is None else m / scale

    def compiled_correction(self) -> Tensor | float:
        """``m²`` of what a compiled call's sums leave out (they are formed
        with one item and no scale, :mod:`kaisa.step.capture.graph`)."""
        correction: Tensor | float = 1.0
        if self.loss_average is LossAverage.ITEMS:
            items = grad_multiplier(self.loss_average, 1, 1, 1, self.items)
            correction = items * items
        scale = self._scale()
        return correction if scale is None else correction / (scale * scale)

    def _scale(self) -> Tensor | float | None:
        return None if self.loss_scale is None else self.loss_scale()
