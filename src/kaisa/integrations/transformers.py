"""Hugging Face ``Trainer``: a callback that preconditions before every optimizer step.

``on_pre_optimizer_step`` runs once per optimizer step, on the accumulation
boundary, after the gradients are averaged — but *after* the Trainer's
gradient clipping (``max_grad_norm``, 1.0 by default).  Clipping first
rescales the raw gradient and so changes the KL clip's verdict; use
``TrainingArguments(max_grad_norm=0)`` and let the KL clip bound the step
(the callback warns when clipping is on)::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[KFACCallback(damping=0.01)])

``accumulation_steps`` is taken from ``gradient_accumulation_steps`` and the
KL clip's learning rate from the Trainer's optimizer, unless given.

A model that accepts loss keyword arguments (Hugging Face language models)
gets ``num_items_in_batch`` from the Trainer: its loss is ``Σ ℓ / N`` with
``N`` the number of target tokens of the whole optimizer step (all
micro-batches, and all ranks with ``average_tokens_across_devices``, where
the Trainer multiplies the loss by the world size).  The callback then uses
``loss_average='items'`` and reads ``N`` from every forward call, so the G
factor sees per-token gradients whatever the padding.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from torch import nn
from transformers import TrainerCallback

from kaisa.config import LossAverage
from kaisa.engines import unwrap_model
from kaisa.preconditioner import KFACPreconditioner

__all__ = ["KFACCallback"]


class KFACCallback(TrainerCallback):
    """Runs a :class:`~kaisa.KFACPreconditioner` inside ``Trainer.train``.

    Args:
        **kwargs: keyword arguments of :class:`~kaisa.KFACPreconditioner`.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.preconditioner: KFACPreconditioner | None = None
        self._items_hook: Any = None
        self._items_divisor = 1

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preconditioner is not None:
            return
        options = dict(self.kwargs)
        options.setdefault("accumulation_steps", args.gradient_accumulation_steps)
        optimizer = kwargs.get("optimizer")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        if "lr" not in options and optimizer is not None:
            options.setdefault("optimizer", optimizer)
        if args.max_grad_norm and args.max_grad_norm > 0:
            warnings.warn(
                f"kaisa: the Trainer clips gradients (max_grad_norm={args.max_grad_norm}) before "
                "K-FAC preconditions them; set TrainingArguments(max_grad_norm=0) and let the KL "
                "clip (kl_clip) bound the update",
                stacklevel=2,
            )
        model = kwargs["model"]
        if "loss_average" not in options and _accepts_loss_kwargs(model):
            options["loss_average"] = LossAverage.ITEMS
        self.preconditioner = KFACPreconditioner(model, **options)
        if self.preconditioner.config.loss_average is LossAverage.ITEMS:
            spread = args.average_tokens_across_devices and args.world_size > 1
            self._items_divisor = args.world_size if spread else 1
            self._items_hook = model.register_forward_pre_hook(self._read_items, with_kwargs=True)

    def _read_items(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        items = kwargs.get("num_items_in_batch")
        if items is not None and self.preconditioner is not None:
            self.preconditioner.loss_items = float(items) / self._items_divisor

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preconditioner is not None:
            self.preconditioner.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preconditioner is not None:
            self.preconditioner.remove_hooks()
        if self._items_hook is not None:
            self._items_hook.remove()
            self._items_hook = None


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """The Trainer's own rule for passing ``num_items_in_batch`` to forward."""
    inner = unwrap_model(model)
    declared = getattr(inner, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    parameters = inspect.signature(inner.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
