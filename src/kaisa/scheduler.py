"""``LambdaParamScheduler``: kfac-pytorch's multiplicative scheduler, in kaisa.

Same signature and arithmetic as ``kfac.scheduler.LambdaParamScheduler``
(kfac-pytorch's CIFAR-10 and ImageNet examples change the factor and
inverse intervals and the damping by epoch with it), so the values change
exactly when and by what kfac-pytorch's would.  It differs in one way: each
new value is validated when it is set, so a schedule that drives damping to
0 fails at that call, naming the option, instead of at a later step.

kfac-pytorch's own scheduler also drives a :class:`kaisa.KFACPreconditioner`
(it writes the underscored attributes kaisa exposes for it), and this one
drives any preconditioner with those attributes, kfac-pytorch's included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LambdaParamScheduler"]

#: the options, and whether the product is cast to int (kfac-pytorch's rule)
_OPTIONS = (
    ("factor_update_steps", True),
    ("inv_update_steps", True),
    ("damping", False),
    ("factor_decay", False),
    ("kl_clip", False),
    ("lr", False),
)


class LambdaParamScheduler:
    """Multiply preconditioner hyperparameters by ``lambda(step)`` at each :meth:`step`.

    Args:
        preconditioner: a :class:`kaisa.KFACPreconditioner` (or kfac-pytorch's).
        factor_update_steps_lambda: the factor the factor-update interval is
            multiplied by; the product is cast to int.
        inv_update_steps_lambda: the same for the inverse-update interval.
        damping_lambda: the factor the damping is multiplied by.
        factor_decay_lambda: the same for the running averages' decay.
        kl_clip_lambda: the same for the KL clip.
        lr_lambda: the same for the learning rate the KL clip assumes.

    Raises:
        ValueError: a lambda is given for an option the preconditioner holds as
            a callable (a callable schedule and a scheduler cannot both own it).
    """

    def __init__(
        self,
        preconditioner: Any,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        self._preconditioner = preconditioner
        given = {
            "factor_update_steps": factor_update_steps_lambda,
            "inv_update_steps": inv_update_steps_lambda,
            "damping": damping_lambda,
            "factor_decay": factor_decay_lambda,
            "kl_clip": kl_clip_lambda,
            "lr": lr_lambda,
        }
        self._lambdas: dict[str, Callable[[int], float]] = {}
        for name, fn in given.items():
            if fn is None:
                continue
            if not callable(fn):
                raise TypeError(f"{name}_lambda must be a callable of the step; got {fn!r}")
            if callable(getattr(preconditioner, f"_{name}")):
                raise ValueError(
                    f"preconditioner.{name} is already a callable of the step and cannot also "
                    f"be scaled by {name}_lambda"
                )
            self._lambdas[name] = fn

    def step(self, step: int | None = None) -> None:
        """Apply each lambda at ``step`` (default: the preconditioner's step count).

        Call it after ``preconditioner.step()`` (kfac-pytorch's examples call
        it once per epoch with ``step=epoch``).
        """
        at = self._preconditioner.steps if step is None else step
        for name, to_int in _OPTIONS:
            fn = self._lambdas.get(name)
            if fn is None:
                continue
            value = getattr(self._preconditioner, f"_{name}") * fn(at)
            value = int(value) if to_int else value
            try:
                setattr(self._preconditioner, name, value)  # kaisa's: validated here
            except AttributeError:  # kfac-pytorch's: a read-only property
                setattr(self._preconditioner, f"_{name}", value)
