"""Checkpoints that load at any world size, fraction and wrapper.

``state_dict()`` gathers every factor (and optionally every second-order
tensor) from its owner to every rank of the data-parallel group, keyed by
layer name and by the names the factor specs and the curvature method
declare; ``load_state_dict()`` validates the whole checkpoint before it
changes anything, then keeps on each rank only what the current plan gives
it.  Layer names are those of the unwrapped model, so a checkpoint moves
between plain, DDP, DataParallel and ``torch.compile`` models; older
checkpoints whose names carry ``module.`` or ``_orig_mod.`` still load.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from kaisa.checkpoint.mirror import FactorMirror
from kaisa.config import KFACConfig
from kaisa.core.specs import FactorKind, FactorSpec
from kaisa.distributed.communicator import Communicator
from kaisa.distributed.plan import WorkPlan
from kaisa.layers.state import KFACLayer
from kaisa.methods.base import CurvatureMethod, HeldTensor
from kaisa.warn import warn_user

__all__ = [
    "STATE_VERSION",
    "Checkpointer",
    "check_saved_factor",
    "check_saved_values",
    "normalise_name",
]

STATE_VERSION = 2
#: what :meth:`KFACPreconditioner.state_dict` writes at the top level
_TOP_LEVEL = frozenset({"version", "steps", "hyperparameters", "layers", "partial"})
_WRAPPER_PARTS = ("module", "_orig_mod")
_INSTANCES = itertools.count()


def normalise_name(name: str) -> str:
    """``name`` without the path components DDP/DataParallel/compile add."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def check_saved_values(entry: str, value: Tensor) -> None:
    """Refuse a loaded tensor kaisa could not have saved (``entry`` names it):
    one without values, of another dtype, or holding NaN/Inf — a checkpoint
    changed or damaged after saving, which must not become the running state."""
    if value.is_meta or not value.is_floating_point():
        what = "a meta tensor (no data)" if value.is_meta else f"of dtype {value.dtype}"
        raise ValueError(f"{entry} is {what}; kaisa saves floating-point tensors with their values")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(
            f"{entry} holds NaN or Inf; kaisa never saves a non-finite tensor, so this "
            "checkpoint was changed or damaged after saving"
        )


#: how far a saved factor may be from symmetric, relative to its largest entry,
#: in units of its dtype's epsilon (at least 1e-5): a Gram product is symmetric
#: to its rounding (a float32 ``aᵀa`` over 400k rows: 2e-7 relative, measured)
_SYMMETRY_EPS = 16.0
#: rows of a factor compared at once
_ROWS = 1024


def check_saved_factor(entry: str, spec: FactorSpec, value: Tensor) -> None:
    """Refuse a loaded Kronecker factor that is no Gram matrix (``entry``
    names it): each diagonal block symmetric, no diagonal entry negative.
    A running average of ``a aᵀ`` is both, to rounding; one that is not was
    changed after saving, and ``eigh`` would read only its lower triangle."""
    check_saved_values(entry, value)
    blocks: list[Tensor] = []
    if spec.kind is FactorKind.DIAGONAL:
        diagonal = value
    else:
        if spec.kind is FactorKind.BLOCK_DIAGONAL:
            blocks = [v for _, v in spec.layout.views(value)]
        else:
            blocks = [value]
        diagonal = torch.cat([b.diagonal(dim1=-2, dim2=-1).reshape(-1) for b in blocks])
    if bool((diagonal < 0).any()):
        raise ValueError(
            f"{entry} has a negative diagonal entry ({float(diagonal.min()):.3g}); a "
            "Kronecker factor is a Gram matrix, positive semidefinite, so this checkpoint "
            "was changed or damaged after saving"
        )
    tolerance = max(1e-5, _SYMMETRY_EPS * torch.finfo(value.dtype).eps)
    for b in blocks:
        # in row blocks of the stored dtype: three float64 copies of an
        # 8192-row factor would take 1.5 GiB, on the device it loaded to
        asymmetry = max(
            float((b[..., i : i + _ROWS, :] - b[..., :, i : i + _ROWS].mT).abs().max())
            for i in range(0, b.shape[-1], _ROWS)
        )
        if asymmetry > tolerance * max(float(b.max()), -float(b.min())):
            raise ValueError(
                f"{entry} is not symmetric (largest |F - Fᵀ| {asymmetry:.3g}); a Kronecker "
                "factor is a Gram matrix, so this checkpoint was changed or damaged after saving"
            )


def check_layer_entry(
    name: str, entry: Any, known: Mapping[str, tuple[int, ...]], factors: Sequence[FactorSpec]
) -> None:
    """Refuse layer ``name``'s checkpoint entry unless every tensor this
    preconditioner knows (``known``: its shape by key) has that shape and
    values it could have saved (:func:`check_saved_factor` for the
    ``factors``); entries it does not know are named in a warning."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"state_dict layer {name!r} must be a mapping of tensors")
    specs = {spec.name: spec for spec in factors}
    unknown = sorted(key for key in entry if key not in known)
    if unknown:
        warn_user(
            f"kaisa: state_dict layer {name!r} holds entries this preconditioner does not "
            f"know, ignored: {unknown} (it holds {sorted(known)})",
        )
    for key, value in entry.items():
        if value is None:
            continue  # not formed yet: absent
        if not isinstance(value, Tensor):
            raise ValueError(f"state_dict entry {name}.{key} is not a tensor")
        if key not in known:
            continue
        if tuple(value.shape) != known[key]:
            raise ValueError(
                f"state_dict entry {name}.{key} has shape {tuple(value.shape)}, "
                f"expected {known[key]} (a checkpoint of another model, or saved with "
                "other max_factor_dim/large_factor options, or with a bias that trained on "
                "one side and was frozen on the other: each changes factor shapes)"
            )
        if key in specs:
            check_saved_factor(f"state_dict entry {name}.{key}", specs[key], value)
        else:
            check_saved_values(f"state_dict entry {name}.{key}", value)


class Checkpointer:
    """Gathers and restores the preconditioner's tensors."""

    def __init__(
        self,
        layers: dict[str, KFACLayer],
        plan: WorkPlan,
        comm: Communicator,
        method: CurvatureMethod,
    ) -> None:
        self.layers = layers
        self.plan = plan
        self.comm = comm
        self.method = method
        self.rank = comm.rank
        #: names this preconditioner's save rounds in the rendezvous store:
        #: the same on every rank when they construct in the same order
        self._uid = next(_INSTANCES)
        self._rounds: dict[int, int] = {}
        #: every factor on rank 0, once a save on rank 0 alone asked for it
        self.mirror = FactorMirror(layers, plan, comm, f"mirror/{self._uid}")

    # -- saving ---------------------------------------------------------------------
    def save(
        self,
        steps: int,
        include_factors: bool,
        include_second_order: bool,
        damping: float,
        timeout_s: float,
        recompute_pending: bool = False,
    ) -> tuple[dict[str, dict[str, Tensor]], dict[str, int] | None]:
        """The layers' state and, for a call not every rank made within
        ``timeout_s``, what marks it partial (this rank's share only).
        ``recompute_pending``: a load left the second-order state to be
        recomputed at the next step (see :meth:`gather`)."""
        # rounds are named by the step and the call's number at that step, so
        # a call some ranks skipped does not shift later rounds' names
        if steps not in self._rounds:
            self._rounds = {steps: -1}
        self._rounds[steps] += 1
        if self.comm.all_present(
            f"state_dict/{self._uid}/{steps}/{self._rounds[steps]}", timeout_s
        ):
            gathered = self.gather(
                include_factors, include_second_order, damping, recompute_pending
            )
            return gathered, None
        self.mirror.request(steps)
        mirrored = self.mirror.refreshed
        held = (
            f"this rank's share and every other factor as of the inverse update at step "
            f"{mirrored} (the mirror a first such save starts)"
            if mirrored is not None
            else "this rank's share (the next such saves also hold every other factor, as of "
            "the last inverse update: this one starts a mirror onto rank 0)"
            if self.rank == 0
            else "this rank's share"
        )
        warn_user(
            f"kaisa: state_dict() was called on rank {self.rank} but not on every rank of the "
            f"{self.comm.world_size}-rank data-parallel group within {timeout_s:g} s. kaisa "
            f"keeps each factor on its owner only, so this checkpoint holds {held}; loading it "
            "starts the statistics of any layer it lacks afresh. For a complete, current "
            "checkpoint call state_dict() on every rank (and save on one)",
        )
        partial = {"rank": self.rank, "world_size": self.comm.world_size}
        if mirrored is not None:
            partial["mirrored_at"] = mirrored
        return self.local(), partial

    def gather(
        self,
        include_factors: bool,
        include_second_order: bool,
        damping: float,
        recompute_pending: bool = False,
    ) -> dict[str, dict[str, Tensor]]:
        """Every layer's tensors, on every rank (collective).  A layer
        captured but never decomposed saves its damping-only stand-ins, as it
        preconditions with them; but where a load left the second-order state
        to be recomputed at the next step (``recompute_pending``), what the
        layers lack is left out, so that a load of this checkpoint recomputes
        it too instead of keeping stand-ins the run never used."""
        out: dict[str, dict[str, Tensor | None]] = {name: {} for name in self.layers}
        for name, layer in self.layers.items():
            lp = self.plan.layer(name)
            dev = layer.adapter.device
            if include_factors:
                for spec, owner, running in zip(layer.factors, lp.owners, layer.running):
                    mine = running if self.rank == owner else None
                    # Whether a factor exists yet is known to its owner only:
                    # send a presence flag after the entries.
                    packed = torch.zeros(spec.numel + 1, dtype=layer.factor_dtype, device=dev)
                    if mine is not None:
                        packed[:-1] = mine.reshape(-1)
                        packed[-1] = 1.0
                    self._gather_into(out[name], spec.name, packed, owner, spec.shape)
            if include_second_order and layer.captured:
                src = lp.grad_workers[0]
                held = self.method.held(layer.factors, lp.colocated)
                if self.rank == src and not recompute_pending:
                    like = torch.empty(0, dtype=layer.inv_dtype, device=dev)
                    self.method.fill_missing(layer, held, damping, like)
                for t in held:
                    packed = torch.ones(t.numel + 1, dtype=layer.inv_dtype, device=dev)
                    value = layer.state.get(t.key) if self.rank == src else None
                    if value is not None:
                        packed[:-1] = value.reshape(-1)
                    elif self.rank == src:
                        packed[-1] = 0.0  # not held: the next step recomputes it
                    self._gather_into(out[name], t.key, packed, src, t.shape)
        self.comm.wait()
        return {
            name: {k: v for k, v in entries.items() if v is not None}
            for name, entries in out.items()
        }

    def local(self) -> dict[str, dict[str, Tensor]]:
        """What this rank holds, without communication: the factors it owns
        (and on rank 0 the mirror of the others', :mod:`kaisa.checkpoint.mirror`) and the
        second-order tensors of the layers it is a worker of (for a
        ``state_dict()`` called on some ranks only)."""
        out: dict[str, dict[str, Tensor]] = {}
        for name, layer in self.layers.items():
            entry: dict[str, Tensor] = {}
            for spec, running in zip(layer.factors, layer.running):
                copy = self.mirror.factors.get((name, spec.name)) if running is None else running
                if copy is not None:
                    entry[spec.name] = copy.detach().clone()
            if layer.decomposed:
                for key, value in layer.state.items():
                    entry[key] = value.detach().clone()
            out[name] = entry
        return out

    def _gather_into(
        self, out: dict[str, Any], key: str, packed: Tensor, src: int, shape: tuple[int, ...]
    ) -> None:
        """``out[key]`` = the tensor packed (with a trailing presence flag) on ``src``."""

        def store(received: list[Tensor]) -> None:
            flat = received[0]
            out[key] = flat[:-1].reshape(shape).clone() if bool(flat[-1] != 0) else None

        self.comm.broadcast(
            [packed], src, range(self.comm.world_size), store, kind="state_broadcast"
        )

    # -- loading --------------------------------------------------------------------
    def validate(
        self, state_dict: Mapping[str, Any], config: KFACConfig, restore: dict[str, Any]
    ) -> tuple[int, dict[str, Mapping[str, Tensor]] | None]:
        """Check everything; return (steps, layers by this model's names)."""
        if not isinstance(state_dict, Mapping) or "steps" not in state_dict:
            raise ValueError(
                "state_dict must be a mapping produced by KFACPreconditioner.state_dict()"
            )
        unknown = sorted(str(k) for k in state_dict if k not in _TOP_LEVEL)
        if unknown:
            warn_user(
                f"kaisa: state_dict entries this preconditioner does not read, ignored: "
                f"{unknown} (it reads {sorted(_TOP_LEVEL)}; the schedule values, kept at the "
                "top level by kfac-pytorch, are under state_dict['hyperparameters'] here)",
            )
        steps = state_dict["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"state_dict['steps'] must be a non-negative int; got {steps!r}")
        version = state_dict.get("version", STATE_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version > STATE_VERSION:
            raise ValueError(
                f"state_dict['version'] is {version!r}; this kaisa reads checkpoints of "
                f"version {STATE_VERSION} and older (one written by a newer kaisa needs it)"
            )
        try:
            dataclasses.replace(config, **restore)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state_dict['hyperparameters'] is invalid: {exc}") from exc
        layers = state_dict.get("layers")
        if layers is None:
            return steps, None
        if not isinstance(layers, Mapping):
            raise ValueError("state_dict['layers'] must be a mapping of layer name to tensors")
        by_name = self._match_names(layers)
        for name, entry in by_name.items():
            layer = self.layers[name]
            check_layer_entry(name, entry, self._known_tensors(layer), layer.factors)
        # None: a factor not formed yet (kfac-pytorch saves a layer it has not
        # captured as {'A': None, 'G': None}); read as absent
        return steps, {
            name: {k: v for k, v in entry.items() if v is not None}
            for name, entry in by_name.items()
        }

    def _match_names(self, layers: Mapping[str, Any]) -> dict[str, Mapping[str, Tensor]]:
        ours = set(self.layers)
        matched: dict[str, Mapping[str, Tensor]] = {}
        unexpected = []
        for key, entry in layers.items():
            name = key if key in ours else normalise_name(key)
            if name in ours and name not in matched:
                matched[name] = entry
            else:
                unexpected.append(key)
        missing = ours - set(matched)
        if missing or unexpected:
            raise ValueError(
                f"state_dict layers do not match this model: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        return matched

    def second_order_shapes(self, layer: KFACLayer) -> dict[str, tuple[int, ...]]:
        """The second-order tensors a worker of ``layer`` holds under either
        layout (its factors on one owner or on two): what a checkpoint may
        hold, so that one taken under one layout loads under the other."""
        known: dict[str, tuple[int, ...]] = {}
        for colocated in (True, False):
            for t in self.method.held(layer.factors, colocated):
                known[t.key] = t.shape
        return known

    def _known_tensors(self, layer: KFACLayer) -> dict[str, tuple[int, ...]]:
        return {spec.name: spec.shape for spec in layer.factors} | self.second_order_shapes(layer)

    def load(
        self,
        layers: dict[str, Mapping[str, Tensor]],
        compute_inverses: bool,
        partial: Any = None,
    ) -> bool:
        """Keep what the plan gives this rank; return whether a recompute is due.

        ``partial``: the mark of a checkpoint taken on some ranks only; the
        statistics of the layers whose factors it lacks start afresh, with a
        warning naming them (their second-order state, where it holds it
        whole, is kept until their next inverse update)."""
        complete = True
        for name, entry in layers.items():
            layer = self.layers[name]
            lp = self.plan.layer(name)
            dev = layer.adapter.device
            # a layer missing a factor (a checkpoint taken on some ranks only)
            # starts its statistics afresh, as a layer never seen does
            layer.captured = all(spec.name in entry for spec in layer.factors)
            for i, (spec, owner) in enumerate(zip(layer.factors, lp.owners)):
                value = entry.get(spec.name)
                keep = layer.captured and value is not None and self.rank == owner
                layer.running[i] = None
                if value is not None and keep:
                    layer.running[i] = value.to(dev, layer.factor_dtype).clone()
            has_second_order = self.holds_second_order(name, entry)
            if layer.captured and not has_second_order:
                complete = False
            # a layer whose factors start afresh but whose second-order state
            # is whole (a partial checkpoint under COMM-OPT holds every
            # layer's) keeps preconditioning with it until its next inverse
            # update, which decomposes the restarted factors
            self.place_second_order(name, entry, layer.captured or has_second_order)
        if partial:
            fresh = [n for n, la in self.layers.items() if not la.captured]
            warn_user(
                f"kaisa: this checkpoint was taken on some ranks only ({partial}); layers "
                f"whose factors it lacks start their statistics afresh: {fresh}",
            )
        return compute_inverses and not complete

    def holds_second_order(self, name: str, entry: Mapping[str, Tensor]) -> bool:
        """Whether ``entry`` holds every second-order tensor a worker of layer
        ``name`` holds under the current plan's layout."""
        layer, lp = self.layers[name], self.plan.layer(name)
        return all(t.key in entry for t in self.method.held(layer.factors, lp.colocated))

    def place_second_order(self, name: str, entry: Mapping[str, Tensor], restored: bool) -> None:
        """Layer ``name``'s second-order tensors from ``entry``, kept where
        this rank is one of its gradient workers; ``restored``: the layer
        counts as decomposed (its tensors are whole, or its factors are and
        the next step recomputes from them)."""
        layer, lp = self.layers[name], self.plan.layer(name)
        held: tuple[HeldTensor, ...] = self.method.held(layer.factors, lp.colocated)
        dev = layer.adapter.device
        layer.state.clear()
        if restored and lp.is_grad_worker(self.rank):
            for t in held:
                if t.key in entry:
                    layer.state[t.key] = entry[t.key].to(dev, layer.inv_dtype).clone()
        layer.decomposed = restored
