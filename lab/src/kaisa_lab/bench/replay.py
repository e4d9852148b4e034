"""A case's held-out seeds run again at the settings another campaign selected.

A campaign tunes every arm on the selection seeds and reports the held-out
ones (:mod:`kaisa_lab.bench.campaign`). Tuning a long case again on another
machine or device costs what it cost the first time; the held-out seeds at
the settings already selected cost a fraction of it. :class:`Replay` is that
comparison: each arm's setting is the one the *source* campaign (another
record folder: the CPU's) selected, by the same protocol for every arm, and
only the held-out seeds run, in one lockstep group a seed, into a record
folder of their own. Its reports read like any case's (``kaisa bench report
CASE --records DIR --selected-from SOURCE``): every arm that ran took the
selection of the same protocol, so the comparison stays fair, and the clock
is the new machine's. What it does not say is whether another device would
have selected other settings: that takes the whole protocol there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kaisa_lab.bench.campaign import ArmState, Campaign, Run, Unit
from kaisa_lab.bench.cases import Arm, TrainCase
from kaisa_lab.bench.protocol import Setting
from kaisa_lab.bench.records import RecordStore

__all__ = ["Replay"]


class Replay(Campaign):
    """``case``'s held-out seeds for ``arms`` (names; None: every arm ``source``
    has selected) at ``source``'s selections, recorded in ``store``; with
    ``compile_model``, every run's model compiled under that backend
    (:mod:`kaisa_lab.cli.compiled`)."""

    def __init__(
        self,
        case: TrainCase,
        store: RecordStore,
        source: Campaign,
        arms: Sequence[str] | None = None,
        compile_model: str | None = None,
    ) -> None:
        #: every replayed run's model compiled under this backend (None: eager)
        self.compile_model = compile_model
        self.source = {arm.name: source.state(arm) for arm in case.arms}
        names = [a.name for a in case.arms]
        unknown = [a for a in arms or () if a not in names]
        if unknown:
            raise ValueError(
                f"arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(names)}"
            )
        if arms is None:
            self.replayed = tuple(a for a in case.arms if self.source[a.name].selected is not None)
        else:
            self.replayed = tuple(a for a in case.arms if a.name in arms)
            waiting = [
                f"{a.name} ({self.source[a.name].stage})"
                for a in self.replayed
                if self.source[a.name].selected is None
            ]
            if waiting:
                raise ValueError(
                    f"arms: no selection yet in {source.store.root} for {', '.join(waiting)}"
                )
        super().__init__(case, store)

    def run(self, arm: Arm, setting: Setting, seed: int, role: str) -> Run:
        """The source's run, its model compiled where the replay says so (a
        key of its own: compiled and eager records never mix)."""
        run = super().run(arm, setting, seed, role)
        if self.compile_model is None:
            return run
        return replace(run, spec=replace(run.spec, compile_model=self.compile_model))

    def state(self, arm: Arm) -> ArmState:
        """The source's selection, held out here or not yet; an arm not
        replayed reads ``skipped``."""
        src = self.source[arm.name]
        if arm not in self.replayed or src.selected is None:
            return ArmState(arm, "skipped", (), None, None)
        missing = self._missing(arm, src.selected, self.protocol.heldout_seeds)
        return ArmState(arm, "heldout" if missing else "done", src.tried, None, src.selected)

    def units(self) -> list[Unit]:
        """One lockstep group a held-out seed, of the replayed arms not yet recorded."""
        units = self.heldout_units([self.state(arm) for arm in self.replayed])
        return [u for u in units if u.runs]

    def runs_left(self, st: ArmState) -> int:
        return 0 if st.stage == "skipped" else super().runs_left(st)

    def known_left(self, st: ArmState) -> set[str]:
        return set() if st.stage == "skipped" else super().known_left(st)
