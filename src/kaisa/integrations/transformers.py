"""Hugging Face ``Trainer``: a callback that preconditions before every optimizer step.

``on_pre_optimizer_step`` runs once per optimizer step, on the accumulation
boundary, after the gradients are averaged — but *after* the Trainer's
gradient clipping (``max_grad_norm``, 1.0 by default).  Clipping first
rescales the raw gradient and so changes the KL clip's verdict; use
``TrainingArguments(max_grad_norm=0)`` and let the KL clip bound the step
(the callback warns when clipping is on)::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[KFACCallback(damping=0.01)])

``accumulation_steps`` is taken from ``gradient_accumulation_steps`` (an
epoch's last step, when the epoch does not divide by it, has fewer
micro-batches, and the Trainer divides its loss by that count: kaisa
follows) and the KL clip's learning rate from the Trainer's optimizer,
unless given.

A model that accepts loss keyword arguments (Hugging Face language models)
gets ``num_items_in_batch`` from the Trainer: its loss is ``Σ ℓ / N`` with
``N`` the number of target tokens of the whole optimizer step (all
micro-batches, and all ranks with ``average_tokens_across_devices``, where
the Trainer multiplies the loss by the world size).  The callback then uses
``loss_average='items'`` and reads ``N`` from every forward call, so the G
factor sees per-token gradients whatever the padding.  A model that takes
``**kwargs`` but averages its loss over the micro-batch (the sequence
classifiers) is declared with ``model.accepts_loss_kwargs = False`` before
the Trainer is built; a mismatch seen in a forward is warned about.

With ``fp16=True`` the Trainer's grad scaler (accelerate's) is kaisa's
``grad_scaler``, divided out of the captured output gradients, and the
gradients are unscaled before :meth:`KFACPreconditioner.step` where the
Trainer has not done so yet.

The preconditioner's state is saved with every Trainer checkpoint
(``kaisa.pt`` in ``checkpoint-<step>``, written by the main process; every
rank takes part in gathering it) and restored when training resumes from
one (``train(resume_from_checkpoint=...)``, from wherever that folder is):
the running factors, the step count and the eigenbases/inverses, which
makes the resume exact at any step (``include_second_order=False`` leaves
them out; see docs/engines.md, "Checkpoints").  Each ``train()`` call builds
its preconditioner afresh, so one callback serves a Trainer trained twice.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from kaisa.config import LossAverage
from kaisa.engines import unwrap_model
from kaisa.preconditioner import KFACPreconditioner
from kaisa.step.loss_scaling import unscale_once
from kaisa.warn import warn_user
from kaisa.wiring import check_callback_options

__all__ = ["KFACCallback"]

#: how to tell the Trainer (and the callback) that a loss is averaged over its micro-batch
_BEFORE = (
    "before building the Trainer: the Trainer then divides the loss by "
    "gradient_accumulation_steps and passes no num_items_in_batch, and the callback reads "
    "the loss as averaged over the batch"
)


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
        check_callback_options(KFACPreconditioner.__init__, kwargs)
        self.include_second_order = include_second_order
        self.kwargs = kwargs
        self.preconditioner: KFACPreconditioner | None = None
        #: reads or checks num_items_in_batch on every forward (None: neither is needed)
        self._loss_hook: Any = None
        self._items_divisor = 1
        self._told = False  #: of a training forward without num_items_in_batch
        #: the running train() call's preconditioner is attached (a new call builds anew)
        self._attached = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()  # a train() that did not end (an exception), or a retried loop
        options = dict(self.kwargs)
        if options.get("accumulation_steps") is None:  # not given, or None: the Trainer's
            options["accumulation_steps"] = args.gradient_accumulation_steps
        wrapper = kwargs.get("optimizer")
        optimizer = getattr(wrapper, "optimizer", wrapper)  # accelerate's wrapper
        if optimizer is not None:  # its lr unless lr= is given; a skipped step empties it
            options.setdefault("optimizer", optimizer)
        scaler = getattr(wrapper, "scaler", None)  # fp16: accelerate's GradScaler
        if scaler is not None:
            options.setdefault("grad_scaler", scaler)
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
        self._attached = True
        self._resume(args, state)
        if self.preconditioner.config.loss_average is LossAverage.ITEMS:
            spread = args.average_tokens_across_devices and args.world_size > 1
            self._items_divisor = args.world_size if spread else 1
            self._loss_hook = model.register_forward_pre_hook(self._read_items, with_kwargs=True)
        elif (
            self.preconditioner.config.loss_average is not LossAverage.SUM
            and args.gradient_accumulation_steps > 1
            and _accepts_loss_kwargs(model)
        ):  # an average divided by the accumulation count, which the Trainer will not do
            self._loss_hook = model.register_forward_pre_hook(self._undivided, with_kwargs=True)

    def _resume(self, args: Any, state: Any) -> None:
        """Load the state saved with the checkpoint training resumes from."""
        if not state.global_step or self.preconditioner is None:
            return
        candidates = (_resumed_from(), args.resume_from_checkpoint)
        folder = next((f for f in candidates if isinstance(f, str) and os.path.isdir(f)), None)
        if folder is None:
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
        elif items is None and module.training and torch.is_grad_enabled() and not self._told:
            self._told = True
            warn_user(
                "kaisa: a training forward got no num_items_in_batch, which KFACCallback reads "
                "because the model takes loss keyword arguments (a compute_loss of your own?). "
                "Where the loss is averaged over each micro-batch, set "
                f"model.accepts_loss_kwargs = False {_BEFORE}",
            )

    def _undivided(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """A loss_average other than 'items' was given for a model that takes
        loss keyword arguments: the Trainer passes it ``num_items_in_batch``
        and does not divide its loss by ``gradient_accumulation_steps``,
        which that average assumes (G would be its square too large)."""
        if kwargs.get("num_items_in_batch") is None or self._told:
            return
        self._told = True
        average = self.kwargs.get("loss_average")
        warn_user(
            f"kaisa: KFACCallback(loss_average={average!r}) reads each micro-batch's loss as "
            "divided by gradient_accumulation_steps, but the Trainer does not divide this "
            "model's loss (it takes loss keyword arguments and is given num_items_in_batch): G "
            "is gradient_accumulation_steps² too large. A loss Σℓ/num_items_in_batch: leave "
            "loss_average out. A loss averaged over the micro-batch (Hugging Face's sequence "
            f"classifiers): set model.accepts_loss_kwargs = False {_BEFORE}",
        )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An epoch's short last step: its loss is divided by the micro-batches
        it has, so kaisa's accumulation_steps follows for that step (given
        ``accumulation_steps``, a ``num_items_in_batch`` loss and DeepSpeed,
        which accumulates itself, are left as they are)."""
        precond = self.preconditioner
        given = self.kwargs.get("accumulation_steps") is not None
        if precond is None or not self._attached or given:
            return
        if precond.config.loss_average is LossAverage.ITEMS or args.deepspeed:
            return
        steps = _micro_batches()
        if steps is not None and steps != precond.accumulation_steps:
            precond.accumulation_steps = steps

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        precond = self.preconditioner
        if precond is not None and self._attached:
            scaler, optimizer = precond.grad_scaler, precond.optimizer
            if scaler is not None and optimizer is not None:
                unscale_once(scaler, optimizer)  # the optimizer's step would, too late for kaisa
            precond.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()

    def _detach(self) -> None:
        """Take the running preconditioner's hooks off the model; the next
        ``train()`` builds a new one (``self.preconditioner`` stays readable)."""
        if self.preconditioner is not None and self._attached:
            self.preconditioner.remove_hooks()
        self._attached = False
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None


# The Trainer hands its callbacks neither itself nor the checkpoint it resumes
# from (``args.resume_from_checkpoint`` is only the command line's), and a
# step's micro-batch count only through itself; both are read from the frames
# of the training loop that called the callback.
def _callers() -> Iterator[FrameType]:
    frame = inspect.currentframe()
    while frame is not None:
        yield frame
        frame = frame.f_back


def _resumed_from() -> str | None:
    """The folder the running ``Trainer.train(resume_from_checkpoint=...)``
    resumes from (None where no training loop's frame holds one)."""
    for frame in _callers():
        if frame.f_code.co_name in ("_inner_training_loop", "train"):
            value = frame.f_locals.get("resume_from_checkpoint")
            if isinstance(value, str):
                return value
    return None


def _micro_batches() -> int | None:
    """The micro-batches of the Trainer's coming optimizer step: fewer than
    ``gradient_accumulation_steps`` in an epoch's last step when the epoch
    does not divide by it, and the Trainer divides that step's loss by
    them (``current_gradient_accumulation_steps``)."""
    for frame in _callers():
        trainer = frame.f_locals.get("self")
        if isinstance(trainer, Trainer):
            steps = getattr(trainer, "current_gradient_accumulation_steps", None)
            return steps if isinstance(steps, int) and steps >= 1 else None
    return None


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """The Trainer's own rule for passing ``num_items_in_batch`` to forward."""
    inner = unwrap_model(model)
    declared = getattr(inner, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    parameters = inspect.signature(inner.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
