"""PyTorch Lightning: a callback that preconditions before every optimizer step.

``on_before_optimizer_step`` runs once per optimizer step, on the
accumulation boundary, after backward, after DDP has averaged the gradients
and after the AMP precision plugin has unscaled them — and before gradient
clipping and the optimizer step.  That is exactly where ``precond.step()``
belongs::

    trainer = Trainer(callbacks=[KFACCallback(damping=0.01)], accumulate_grad_batches=2)

``accumulation_steps`` is taken from ``accumulate_grad_batches``, the
optimizers from ``configure_optimizers`` (the KL clip's learning rate from
the first), and the grad scaler from the precision plugin, unless given.
With several optimizers (manual optimization: Muon on the hidden matrices,
AdamW on the rest), each ``step()`` of one fires the hook; the gradients are
preconditioned once, at the first after a backward (or a batch's start).
The preconditioner's state is saved in and restored from Lightning
checkpoints: the running factors, the step count and the
eigenbases/inverses, so a resume is exact at any step.  With
``include_second_order=False`` the eigenbases/inverses are left out and
recomputed at the first step after the resume, from factors that already
hold that step's batch, so the resumed run equals the uninterrupted one only
where that step is an inverse update step anyway (see docs/engines.md,
"Checkpoints").
The second-order state costs about as much again as the factors (eigen: the
eigenbases, as large as the factors, plus their eigenvalues).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from kaisa.preconditioner import KFACPreconditioner
from kaisa.wiring import check_callback_options

__all__ = ["KFACCallback"]


class KFACCallback(Callback):
    """Runs a :class:`~kaisa.KFACPreconditioner` inside ``Trainer.fit``.

    Args:
        include_second_order: save the eigenbases/inverses in checkpoints, so a
            resume is exact at any step (the default); False saves about half
            the bytes and recomputes them from the factors on resume.
        **kwargs: keyword arguments of :class:`~kaisa.KFACPreconditioner`.
    """

    def __init__(self, include_second_order: bool = True, **kwargs: Any) -> None:
        super().__init__()
        if not isinstance(include_second_order, bool):
            raise TypeError(
                f"include_second_order must be a bool; got {type(include_second_order).__name__}"
            )
        check_callback_options(KFACPreconditioner.__init__, kwargs)
        self.include_second_order = include_second_order
        self.kwargs = kwargs
        self.preconditioner: KFACPreconditioner | None = None
        self._pending_state: dict[str, Any] | None = None
        #: a backward has run since the last precondition (several optimizers
        #: each fire on_before_optimizer_step for the same gradients)
        self._fresh = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        kwargs = dict(self.kwargs)
        if kwargs.get("accumulation_steps") is None:  # not given, or None: the Trainer's
            kwargs["accumulation_steps"] = trainer.accumulate_grad_batches
        if trainer.optimizers:
            several = len(trainer.optimizers) > 1
            kwargs.setdefault(
                "optimizer", list(trainer.optimizers) if several else trainer.optimizers[0]
            )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            kwargs.setdefault("grad_scaler", scaler)
        if self.preconditioner is not None:  # a second fit() continues from the first, exactly
            self._pending_state = self.preconditioner.state_dict(include_second_order=True)
            # off the model, where the first fit() raised before on_fit_end took them
            self.preconditioner.remove_hooks()
        self.preconditioner = KFACPreconditioner(pl_module, **kwargs)
        if self._pending_state is not None:
            self.preconditioner.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._fresh = True  # also where a manual loop calls loss.backward() itself

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fresh = True

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.preconditioner is not None and self._fresh:
            self._fresh = False
            self.preconditioner.step()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.preconditioner is not None:
            self.preconditioner.remove_hooks()

    def state_dict(self) -> dict[str, Any]:
        if self.preconditioner is None:
            return {}
        return self.preconditioner.state_dict(include_second_order=self.include_second_order)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.preconditioner is None:  # restored before fit starts
            self._pending_state = state_dict
        else:
            self.preconditioner.load_state_dict(state_dict)
