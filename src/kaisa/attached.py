"""What a preconditioner is attached to, fixed at construction; mixed into
:class:`kaisa.KFACPreconditioner`.

The model's hooks, the layers' adapters, the optimizers whose gradients a
skipped step takes away and the lr the KL clip reads are all bound when the
preconditioner is built, so assigning ``precond.model``, ``precond.optimizer``
or ``precond.grad_scaler`` afterwards would change what the attribute reads
and nothing it does; such an assignment is refused.  A copy (``deepcopy``,
``pickle``) would be bound to nothing at all: the copied model carries inert
hooks, so the copy would precondition with frozen factors forever.  It is
refused too, with the way that works: a new preconditioner on the copied
model, given the old one's ``state_dict()``.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

__all__ = ["Attached"]

_COPY = (
    "a KFACPreconditioner cannot be copied or pickled: it is bound to its model's "
    "hooks, and a copy would capture nothing. Build a new one on the copied model and "
    "give it the old one's state: new = KFACPreconditioner(model_copy, ...); "
    "new.load_state_dict(precond.state_dict())"
)


def _fixed(name: str) -> NoReturn:
    raise AttributeError(
        f"precond.{name} is fixed at construction (hooks, layers and the skipped-step "
        f"rule are bound to it); build a new KFACPreconditioner with the new {name} and "
        "load_state_dict(precond.state_dict()) to carry the state over"
    )


class Attached:
    """``model``, ``optimizer`` and ``grad_scaler``, read-only; no copies."""

    _model: nn.Module
    _optimizer: Any
    _grad_scaler: Any

    @property
    def model(self) -> nn.Module:
        """The model given at construction."""
        return self._model

    @model.setter
    def model(self, value: nn.Module) -> None:
        _fixed("model")

    @property
    def optimizer(self) -> Any:
        """The optimizer (or optimizers) given at construction, or None."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        _fixed("optimizer")

    @property
    def grad_scaler(self) -> Any:
        """The loss scaler in use (given, or the engine's), or None."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, value: Any) -> None:
        _fixed("grad_scaler")

    def __copy__(self) -> NoReturn:
        raise TypeError(_COPY)

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise TypeError(_COPY)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(_COPY)
