"""Which layers take part in a step's preconditioning, and what is said of the others.

A layer takes part when it was captured (or its second-order state was
restored from a checkpoint) and has a gradient.  One with a
gradient but no statistics (called functionally, or compiled before kaisa's
hooks existed) is left unchanged, with a warning once.  Where gradients are
averaged by hand, a layer may have a gradient on some ranks only; it is kept
only where every rank has one (one vote over the group, or the presence the
finiteness check already and-ed), so no rank waits on a collective the
others skip.
"""

from __future__ import annotations

from collections.abc import Mapping

from kaisa.distributed.communicator import Communicator
from kaisa.engines.base import Engine
from kaisa.layers.state import KFACLayer
from kaisa.warn import warn_user

__all__ = ["Participation"]


class Participation:
    """Decides each step's layers; warns once per layer about those left out."""

    def __init__(self, comm: Communicator, engine: Engine) -> None:
        self.comm = comm
        self.engine = engine
        self._warned: set[str] = set()

    def taking_part(
        self, layers: list[KFACLayer], factor_step: bool, presence: Mapping[str, bool] | None
    ) -> list[KFACLayer]:
        """Captured layers with a gradient, kept where every rank has one
        (``presence``: each layer's presence already and-ed over the group)."""
        local: list[KFACLayer] = []
        for layer in layers:
            if not self.engine.present(layer.adapter):
                continue
            if not layer.preconditions:
                if factor_step and not layer.eval_forward:  # eval mode: said by the pipeline
                    self._warn_once(
                        layer.name,
                        f"kaisa: layer {layer.name!r} has a gradient but its hooks never "
                        "captured statistics (is it called functionally, or was the model "
                        "compiled and run before KFACPreconditioner was built? dynamo does "
                        "not see hooks added after its first compile); its gradient is "
                        "left unchanged",
                    )
                continue
            local.append(layer)
        if not self.comm.distributed or self.engine.gradients_agree():
            return local
        candidates = [la for la in layers if la.preconditions]
        mine = {la.name for la in local}
        if presence is None:
            agreed = self.comm.agree_all(
                [la.name in mine for la in candidates], layers[0].adapter.device
            )
        else:  # preconditions is the same everywhere: and-ing presence alone is enough
            agreed = [presence[la.name] for la in candidates]
        kept = []
        for layer, ok in zip(candidates, agreed, strict=True):
            if ok:
                kept.append(layer)
            elif layer.name in mine:
                self._warn_once(
                    layer.name,
                    f"kaisa: layer {layer.name!r} has a gradient on some ranks only this step; "
                    "it is left unchanged on every rank (average gradients over all ranks, "
                    "e.g. with DDP(find_unused_parameters=True), to precondition it)",
                )
        return kept

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warn_user(message)
