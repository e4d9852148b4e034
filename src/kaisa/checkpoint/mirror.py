"""A copy of every factor on rank 0, for checkpoints saved on rank 0 only.

kaisa keeps each factor on its owner, so a ``state_dict()`` that only rank 0
calls (kfac-pytorch's examples save that way) can return only rank 0's
share.  The first such save asks, through the rendezvous store, for a
mirror: from two steps later on, at every inverse update, each factor rank
0 does not own is summed onto rank 0 (its owner sends it, the others send
zeros), so later rank-0-only saves hold every layer's factors, as of the
last inverse update.  Nothing is sent until a save asks for it, so runs
that save on every rank pay nothing.

Why two steps: rank 0 writes the start step while the other ranks are at
most one step away (every training step synchronises the ranks: DDP's
all-reduce or kaisa's own presence vote), so every rank has read the
request before any rank reaches the start step, and all start together.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kaisa.core.specs import FactorSpec
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.plan import WorkPlan
from kaisa.layers.state import KFACLayer

__all__ = ["FactorMirror"]


class FactorMirror:
    """Every factor, on rank 0, refreshed at inverse updates once asked for."""

    def __init__(
        self, layers: dict[str, KFACLayer], plan: WorkPlan, comm: Communicator, key: str
    ) -> None:
        self.layers = layers
        self.plan = plan
        self.comm = comm
        self.key = key
        self.start: int | None = None
        #: (layer, factor) → the owner's running factor at ``refreshed``
        self.factors: dict[tuple[str, str], Tensor] = {}
        self.refreshed: int | None = None

    def request(self, steps: int) -> None:
        """Called by rank 0 on a save the other ranks did not join."""
        if self.comm.rank == 0 and self.comm.distributed and self.start is None:
            self.comm.publish(self.key, str(steps + 2))

    def at_inverse_step(self, step: int) -> None:
        """Every rank, at every inverse update: refresh the mirror once it is on."""
        if not self.comm.distributed:
            return
        if self.start is None:
            value = self.comm.published(self.key)
            if value is None:
                return
            self.start = int(value)
        if step < self.start:
            return
        for name, layer in self.layers.items():
            owners = self.plan.layer(name).owners
            for spec, owner, running in zip(layer.factors, owners, layer.running):
                if owner != 0:
                    self._send(name, spec, layer, owner, running)
        self.comm.wait()
        self.refreshed = step

    def _send(
        self, name: str, spec: FactorSpec, layer: KFACLayer, owner: int, running: Tensor | None
    ) -> None:
        # a trailing presence flag: whether the owner has the factor yet
        packed = torch.zeros(spec.numel + 1, dtype=layer.factor_dtype, device=layer.adapter.device)
        if self.comm.rank == owner and running is not None:
            packed[:-1] = running.reshape(-1)
            packed[-1] = 1.0

        def keep(received: list[Tensor]) -> None:
            flat = received[0]
            if bool(flat[-1] != 0):
                self.factors[(name, spec.name)] = flat[:-1].reshape(spec.shape).clone()

        self.comm.reduce_sum(packed, 0, keep, kind="checkpoint_mirror")
