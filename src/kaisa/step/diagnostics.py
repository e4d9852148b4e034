"""What the step decided, recorded only when asked (read-only diagnostics).

The KL clip's scale ``ν`` is formed inside the step and applied at once; a
study of *what sets the step* needs it per step.
:class:`StepDiagnostics` is filled by the step only while it is attached
(``precond.diagnostics = StepDiagnostics()``): off, the step pays one
attribute test.  On, it keeps ``ν`` as the step formed it — a Python number
on CPU, a 0-d tensor elsewhere — so recording adds no host synchronisation;
:attr:`StepDiagnostics.kl_scales` converts (and synchronises) when read.
The eigenvalues of the factors need no hook: ``precond.layers[name].factor("A")``
is the running factor, to decompose off the step.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["StepDiagnostics"]


class StepDiagnostics:
    """``ν`` of every step while attached (None where the clip is off).

    Applied steps are counted from the attachment (a step skipped for
    non-finite gradients applies nothing and records nothing)."""

    def __init__(self) -> None:
        self._nu: list[Tensor | float | None] = []

    def record_kl_scale(self, nu: Tensor | float | None) -> None:
        """Called by the step with the scale it applied (kept as is)."""
        self._nu.append(nu)

    @property
    def kl_scales(self) -> list[float | None]:
        """``ν`` per applied step as numbers (1.0: the clip did not bind)."""
        return [None if nu is None else float(nu) for nu in self._nu]

    def clear(self) -> None:
        self._nu.clear()
