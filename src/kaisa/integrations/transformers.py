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

The preconditioner's state is saved with every Trainer checkpoint
(``kaisa.pt`` in ``checkpoint-<step>``, written by the main process; every
rank takes part in gathering it) and restored when training resumes from
one (``resume_from_checkpoint``): the running factors, the step count and
the eigenbases/inverses, which makes the resume exact at any step
(``include_second_order=False`` leaves them out; see docs/engines.md,
"Checkpoints").
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from kaisa.config import LossAverage
from kaisa.engines import unwrap_model
from kaisa.preconditioner import KFACPreconditioner
from kaisa.warn import warn_user

__all__ = ["KFACCallback"]


class KFACCallback(TrainerCallback):
    """Runs a :class:`~kaisa.KFACPreconditioner` inside ``Trainer.train``.

    Args:
        include_second_order: save the eigenbases/inverses in checkpoints, so a
            resume is exact at any step (the default); False saves about half
            the bytes and recomputes them from the factors on resume.
        **kwargs: keyword arguments of :class:`~kaisa.KFACPreconditioner`.
    """

    #: the preconditioner's file in a Trainer checkpoint folder
    STATE_NAME = "kaisa.pt"

    def __init__(self, include_second_order: bool = True, **kwargs: Any) -> None:
        if not isinstance(include_second_order, bool):
            raise TypeError(
                f"include_second_order must be a bool; got {type(include_second_order).__name__}"
            )
        self.include_second_order = include_second_order
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
        if optimizer is not None:  # its lr unless lr= is given; a skipped step empties it
            options.setdefault("optimizer", optimizer)
        if args.max_grad_norm and args.max_grad_norm > 0:
            warn_user(
                f"kaisa: the Trainer clips gradients (max_grad_norm={args.max_grad_norm}) before "
                "K-FAC preconditions them; set TrainingArguments(max_grad_norm=0) and let the KL "
                "clip (kl_clip) bound the update",
            )
        model = kwargs["model"]
        if "loss_average" not in options and _accepts_loss_kwargs(model):
            options["loss_average"] = LossAverage.ITEMS
        self.preconditioner = KFACPreconditioner(model, **options)
        self._resume(args, state)
        if self.preconditioner.config.loss_average is LossAverage.ITEMS:
            spread = args.average_tokens_across_devices and args.world_size > 1
            self._items_divisor = args.world_size if spread else 1
            self._items_hook = model.register_forward_pre_hook(self._read_items, with_kwargs=True)

    def _resume(self, args: Any, state: Any) -> None:
        """Load the state saved with the checkpoint training resumes from."""
        if not state.global_step or self.preconditioner is None:
            return
        folder = args.resume_from_checkpoint
        if not isinstance(folder, str) or not os.path.isdir(folder):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(folder, self.STATE_NAME)
        if not os.path.isfile(path):
            warn_user(
                f"kaisa: training resumes at step {state.global_step} but {path} does not exist: "
                "the preconditioner starts afresh (its factors from the next batch)",
            )
            return
        self.preconditioner.load_state_dict(torch.load(path, map_location="cpu"))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preconditioner is None:
            return
        saved = self.preconditioner.state_dict(include_second_order=self.include_second_order)
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(saved, os.path.join(folder, self.STATE_NAME))

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
