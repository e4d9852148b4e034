"""One run's model, optimizer and preconditioner, and its training step.

Shared by every loop that trains (:func:`kaisa_lab.cli.train.train_lockstep`,
:func:`kaisa_lab.cli.train.warm_up`) so that all of them execute exactly the
same code.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from kaisa_lab.cli.compiled import compile_run
from kaisa_lab.cli.distributed import DistContext
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.levers import (
    FISHERS,
    KFAC_LAYERS,
    PowerEigen,
    adamw_part_skips,
    mc_fisher_backward,
)
from kaisa_lab.optim import MuonWithAdamW, build_optimizer
from kaisa_lab.tasks.base import Task

__all__ = ["Trainer", "make_optimizer", "weights_fingerprint"]


def make_optimizer(spec: RunSpec, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``spec`` over ``model`` (:func:`kaisa_lab.optim.build_optimizer`)."""
    return build_optimizer(
        spec.optimizer,
        model,
        lr=spec.lr,
        weight_decay=spec.weight_decay,
        momentum=spec.momentum,
        adamw_lr=spec.adamw_lr,
        adamw_weight_decay=spec.adamw_weight_decay,
        compile_baseline=spec.compile_baseline,
        muon_ns_steps=spec.muon_ns_steps,
    )


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer, by name: equal for bit-identical weights.

    A comparison is only fair if its arms start from the same weights; the
    fingerprint goes into every run's record so that this can be checked
    after the fact, not assumed."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class Trainer:
    """Model, optimizer and (optional) preconditioner of one run, and its training step.

    Use as a context manager: K-FAC's hooks are removed on exit. The model is
    built right after seeding the global generator with ``spec.seed``, so runs
    that differ only in the optimizer start from bit-identical weights
    (:attr:`initial_weights` records them).
    """

    def __init__(self, spec: RunSpec, task: Task, ctx: DistContext) -> None:
        self.task = task
        self.device = ctx.device
        torch.manual_seed(spec.seed)
        self.model = task.build_model().to(ctx.device)
        self.initial_weights = weights_fingerprint(self.model)
        self.net = ctx.wrap(self.model)
        self.optimizer = make_optimizer(spec, self.model)
        # The schedule scales every group's own lr (muon's AdamW part has another).
        self._lr_scales = [group["lr"] / spec.lr for group in self.optimizer.param_groups]
        self.preconditioner: Any = None
        if spec.kfac_layers not in KFAC_LAYERS or (
            spec.kfac_layers != "all" and (spec.optimizer != "muon" or not spec.kfac)
        ):
            raise ValueError(
                f"kfac_layers={spec.kfac_layers!r}: one of {KFAC_LAYERS}, "
                "'adamw-part' under muon with K-FAC only"
            )
        if spec.kfac:
            # Imported here so that first-order runs work even while the
            # preconditioner module is missing or broken.
            from kaisa.preconditioner import KFACPreconditioner

            # Hooks go on the unwrapped model so layer names (and the
            # --kfac-skip-layers patterns matched against them) do not depend on DDP.
            options = dict(spec.kfac_kwargs)
            if spec.kfac_layers == "adamw-part":
                assert isinstance(self.optimizer, MuonWithAdamW)
                skips = adamw_part_skips(self.optimizer.split.muon)
                options["skip_layers"] = [*options.get("skip_layers", ()), *skips]
            if spec.eigen_power is not None:
                options["method"] = PowerEigen(spec.eigen_power)
            if spec.position_fraction is not None:
                # the library's draws, seeded per run (the same on every rank)
                options["factor_position_fraction"] = spec.position_fraction
                options["factor_position_seed"] = 20_000 + spec.seed
            self.preconditioner = KFACPreconditioner(
                self.model, optimizer=self.optimizer, pg_timeout_s=ctx.timeout_s, **options
            )
        if spec.position_fraction is not None and not spec.kfac:
            raise ValueError("position_fraction: a K-FAC run's option")
        if spec.fisher not in FISHERS or (spec.fisher != "empirical" and not spec.kfac):
            raise ValueError(f"fisher={spec.fisher!r}: one of {FISHERS}, and 'mc' with K-FAC only")
        #: the sampled labels' own stream (the global one stays as the other runs see it)
        self._mc = (
            torch.Generator().manual_seed(10_000 + spec.seed) if spec.fisher == "mc" else None
        )
        #: whether the model runs compiled (:mod:`kaisa_lab.cli.compiled`)
        self.compiled = spec.compile_model is not None
        if self.compiled:
            # after K-FAC is attached: its statistics are then formed in the graphs
            self.net = compile_run(spec, self.net, self.preconditioner, ctx.device)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove K-FAC's hooks (idempotent)."""
        if self.preconditioner is not None:
            self.preconditioner.remove_hooks()

    def state_dict(self) -> dict[str, Any]:
        """Everything the run's next steps depend on (weights, the optimizer's
        and the preconditioner's state, the levers' own generators), so that a
        run restored by :meth:`load_state_dict` goes on bit for bit."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "preconditioner": (
                None if self.preconditioner is None else self.preconditioner.state_dict()
            ),
            "generators": {} if self._mc is None else {"mc": self._mc.get_state()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from a run of the same spec)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.preconditioner is not None:
            self.preconditioner.load_state_dict(state["preconditioner"])
        if self._mc is not None:
            self._mc.set_state(state["generators"]["mc"])

    def set_lr(self, lr: float) -> None:
        """Set the lr of the run's schedule: each parameter group's lr is ``lr`` times its
        own initial lr over the run's (1 for every group but muon's AdamW part, so
        exactly ``lr`` there); K-FAC reads it from the optimizer at its step."""
        for group, scale in zip(self.optimizer.param_groups, self._lr_scales):
            group["lr"] = lr * scale

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a batch; returns the (detached) batch loss."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.compiled:
            # one graph for every batch size (an epoch's last batch may be short)
            torch._dynamo.mark_dynamic(x, 0)
        self.optimizer.zero_grad(set_to_none=True)
        precond = self.preconditioner
        if self._mc is not None and precond.factor_step:
            loss = mc_fisher_backward(self.net, x, y, self.task.loss, precond.paused, self._mc)
        else:
            loss = self.task.loss(self.net(x), y)
            loss.backward()
        if self.preconditioner is not None:
            self.preconditioner.step()
        self.optimizer.step()
        return loss.detach()
