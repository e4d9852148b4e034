"""Hugging Face ``Trainer``: a callback that preconditions before every optimizer step.

``on_pre_optimizer_step`` runs once per optimizer step, on the accumulation
boundary, after the gradients are averaged — but *after* the Trainer's
gradient clipping (``max_grad_norm``, 1.0 by default).  Clipping first
rescales the raw gradient and so changes the KL clip's verdict; use
``TrainingArguments(max_grad_norm=0)`` and let the KL clip bound the step
(the callback warns when clipping is on)::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[KFACCallback(damping=0.01)])

``accumulation_steps`` is taken from ``gradient_accumulation_steps`` and the
KL clip's learning rate from the Trainer's optimizer, unless given.  A model
whose forward takes ``num_items_in_batch`` has its loss normalised by the
Trainer over all micro-batches' tokens: pass ``loss_average`` to match.
"""

from __future__ import annotations

import warnings
from typing import Any

from transformers import TrainerCallback

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
        self.preconditioner = KFACPreconditioner(kwargs["model"], **options)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preconditioner is not None:
            self.preconditioner.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preconditioner is not None:
            self.preconditioner.remove_hooks()
