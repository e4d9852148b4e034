"""``KFACPreconditioner``: the orchestration of one K-FAC step.

``step()`` reads top to bottom as the data flow of the method::

    capture (hooks, during forward/backward)      kaisa.capture
    → batch statistics                            kaisa.factors
    → reduce to the factor's owner                kaisa.comm
    → running average (owner only)                kaisa.factors
    → decompose (owner only)                      kaisa.decompose
    → broadcast to the layer's gradient workers   kaisa.comm
    → precondition (gradient workers)             kaisa.precondition
    → broadcast preconditioned gradients          kaisa.comm
    → KL-clip scale, write back into .grad        kaisa.precondition, kaisa.grads

Who does what is fixed once, at construction, by the work plan
(:mod:`kaisa.plan`).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from kaisa.capture import Capture
from kaisa.comm import Communicator, dist_info
from kaisa.config import ComputeMethod, KFACConfig, resolve
from kaisa.decompose import pi_split
from kaisa.grads import GradientAccess, ParamGradAccess, read_grad_matrix, write_grad_matrix
from kaisa.layer import KFACLayer
from kaisa.layers.registry import SkippedModule, register_layers
from kaisa.plan import LayerPlan, LayerSpec, WorkPlan, make_plan
from kaisa.precondition import kl_clip_scale

__all__ = ["KFACPreconditioner"]

logger = logging.getLogger("kaisa")

_WRAPPERS = (nn.parallel.DistributedDataParallel, nn.DataParallel)

_STATE_VERSION = 1


class KFACPreconditioner:
    """Distributed K-FAC gradient preconditioner.

    Construct once, then call :meth:`step` after ``loss.backward()`` and
    before ``optimizer.step()``; it rewrites the ``.grad`` of every registered
    layer with its K-FAC preconditioned (and KL-clipped) gradient and never
    touches the weights::

        precond = KFACPreconditioner(model, optimizer=optimizer)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            precond.step()
            optimizer.step()

    Keyword arguments are those of kfac-pytorch's ``KFACPreconditioner`` (see
    :class:`kaisa.KFACConfig` for their meaning and allowed values), plus:

    Args:
        model: the model (or its DDP wrapper).  Every ``nn.Linear`` and
            ``nn.Conv2d`` (groups=1) whose parameters all require grad is
            registered, except those matching ``skip_layers``.
        optimizer: if given and ``lr`` is not, the learning rate used by the
            KL clip is read from its first param group at every step.
        grad_scaler: a ``torch.amp.GradScaler``; its scale is divided out of
            the captured output gradients.  Call ``scaler.unscale_(optimizer)``
            before :meth:`step` so the KL clip sees true gradients.
        gradient_access: how gradients are read and written (default: ``.grad``).
        pg_timeout_s: timeout of the process groups kaisa creates.
        loglevel: accepted for kfac-pytorch compatibility; kaisa logs to the
            ``"kaisa"`` logger at DEBUG.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        grad_scaler: Any | None = None,
        gradient_access: GradientAccess | None = None,
        pg_timeout_s: float | None = None,
        lr: float | Callable[[int], float] | None = None,
        loglevel: int = logging.DEBUG,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
        unknown = set(kwargs) - set(KFACConfig.field_names())
        if unknown:
            raise TypeError(
                f"unknown keyword argument(s) {sorted(unknown)}; allowed: "
                f"{sorted(KFACConfig.field_names())}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}"
            )
        if pg_timeout_s is not None and not (
            isinstance(pg_timeout_s, (int, float)) and pg_timeout_s > 0
        ):
            raise ValueError(
                f"pg_timeout_s must be a positive number of seconds; got {pg_timeout_s!r}"
            )
        self.config = KFACConfig(lr=0.1 if lr is None else lr, **kwargs)
        self._lr_from_optimizer = lr is None and optimizer is not None
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.gradient_access: GradientAccess = gradient_access or ParamGradAccess()
        self.model = model
        self.steps = 0
        self._loglevel = loglevel
        cfg = self.config
        if (
            isinstance(cfg.inv_update_steps, int)
            and isinstance(cfg.factor_update_steps, int)
            and cfg.inv_update_steps % cfg.factor_update_steps != 0
        ):
            warnings.warn(
                f"inv_update_steps ({cfg.inv_update_steps}) is not a multiple of "
                f"factor_update_steps ({cfg.factor_update_steps}): some decompositions will "
                "reuse unchanged factors",
                stacklevel=2,
            )

        # Layers are named inside DDP/DataParallel wrappers, so that a
        # checkpoint loads whether or not the model is wrapped.
        inner = model.module if isinstance(model, _WRAPPERS) else model
        adapters, self.skipped = register_layers(inner, cfg.skip_layers)
        if not adapters:
            reasons = "; ".join(f"{s.name or '<root>'}: {s.reason}" for s in self.skipped)
            raise ValueError(
                "model has no layer K-FAC can precondition (supported: nn.Linear, nn.Conv2d "
                f"with groups=1, all parameters requiring grad). Skipped: {reasons or 'nothing'}"
            )
        self.layers: dict[str, KFACLayer] = {}
        for adapter in adapters:
            weight_dtype = adapter.weight.dtype
            base = torch.promote_types(weight_dtype, torch.float32)
            # normalised to torch.dtype | None by KFACConfig.__post_init__
            factor_dtype = cast("torch.dtype | None", cfg.factor_dtype) or base
            inv_dtype = cast("torch.dtype | None", cfg.inv_dtype) or torch.promote_types(
                factor_dtype, torch.float32
            )
            self.layers[adapter.name] = KFACLayer(adapter, factor_dtype, inv_dtype)

        # Who does what: fixed once, the same on every rank.
        specs = [LayerSpec(n, la.adapter.a_dim, la.adapter.g_dim) for n, la in self.layers.items()]
        rank, world = dist_info()
        self.plan: WorkPlan = make_plan(
            specs,
            world,
            cfg.worker_fraction,
            cfg.assignment_strategy,
            cfg.colocate_factors,
        )
        self.rank = rank
        groups = list(self.plan.worker_groups) + list(self.plan.receiver_groups)
        self.comm = Communicator(
            groups,
            bucket_cap_mb=cfg.allreduce_bucket_cap_mb,
            symmetry_aware=cfg.symmetry_aware,
            timeout_s=pg_timeout_s,
        )
        self._stale_second_order = False

        self.capture = Capture(
            model,
            list(self.layers.values()),
            loss_average=cfg.loss_average,  # type: ignore[arg-type]
            accumulation_steps=cfg.accumulation_steps,
            in_hook=cfg.update_factors_in_hook,
            loss_scale=self._loss_scale if grad_scaler is not None else None,
        )
        self.capture.enabled = self._is_factor_step(0)
        if cfg.update_factors_in_hook and self.comm.distributed:
            self.capture.on_grad_captured = self._maybe_launch_reduce
        self._launched: set[str] = set()
        self._warned: set[str] = set()
        logger.log(loglevel, "%s", self.describe())

    # ------------------------------------------------------------------
    # hyperparameters
    def _value(self, name: str, step: int | None = None) -> Any:
        return resolve(name, getattr(self.config, name), self.steps if step is None else step)

    @property
    def lr(self) -> float:
        if self._lr_from_optimizer:
            assert self.optimizer is not None
            value = self.optimizer.param_groups[0]["lr"]
            return float(value.item() if isinstance(value, Tensor) else value)
        return float(self._value("lr"))

    @property
    def damping(self) -> float:
        return float(self._value("damping"))

    @property
    def factor_decay(self) -> float:
        return float(self._value("factor_decay"))

    @property
    def kl_clip(self) -> float | None:
        value = self._value("kl_clip")
        return None if value is None else float(value)

    def _is_factor_step(self, step: int) -> bool:
        return step % int(self._value("factor_update_steps", step)) == 0

    def _is_inverse_step(self, step: int) -> bool:
        return step % int(self._value("inv_update_steps", step)) == 0

    def _loss_scale(self) -> Tensor | float | None:
        scaler = self.grad_scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        getter = getattr(scaler, "_get_scale_async", None)
        scale = getter() if getter is not None else scaler.get_scale()
        return scale

    # ------------------------------------------------------------------
    # the step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of every registered layer in place."""
        if not self.capture.active:
            raise RuntimeError("step() called after remove_hooks(); create a new preconditioner")
        step = self.steps
        damping = self.damping
        if self._is_factor_step(step):
            self._update_factors(self.factor_decay)
        if self._is_inverse_step(step) or self._stale_second_order:
            self._update_second_order(damping)
        self._precondition(damping)
        self.comm.stats.end_step()
        self.steps += 1
        self.capture.enabled = self._is_factor_step(self.steps)

    # capture → statistics → reduce → running average -----------------------
    def _layer_batch(self, layer: KFACLayer) -> tuple[Tensor, Tensor] | None:
        if not self.config.update_factors_in_hook:
            self.capture.flush(layer)
        if not layer.stats.has_batch:
            return None
        return layer.stats.batch_factors()

    def _reduce_layer(self, layer: KFACLayer, decay: float) -> None:
        """Send the layer's batch factors to their owners, who fold them in."""
        batch = self._layer_batch(layer)
        layer.stats.reset()
        if batch is None:
            return
        layer.captured = True
        lp = self.plan.layer(layer.name)
        a_batch, g_batch = batch
        if lp.colocated:
            self.comm.reduce_mean(
                [a_batch, g_batch], lp.a_decomposer, lambda t: layer.stats.update(t[0], t[1], decay)
            )
        else:
            self.comm.reduce_mean(
                [a_batch], lp.a_decomposer, lambda t: layer.stats.update(t[0], None, decay)
            )
            self.comm.reduce_mean(
                [g_batch], lp.g_decomposer, lambda t: layer.stats.update(None, t[0], decay)
            )

    def _maybe_launch_reduce(self, layer: KFACLayer) -> None:
        """Backward-hook callback: start reducing a layer as soon as it is complete."""
        stats = layer.stats
        if (
            stats.grad_calls == stats.calls
            and stats.g_passes >= self.config.accumulation_steps
            and layer.name not in self._launched
        ):
            self._launched.add(layer.name)
            self._reduce_layer(layer, self.factor_decay)

    def _update_factors(self, decay: float) -> None:
        if (
            self.steps == 0
            and not any(la.stats.calls or la.pending.inputs for la in self.layers.values())
            and not self._launched
        ):
            raise RuntimeError(
                "step() was called before any forward/backward pass was captured: call "
                "loss.backward() on a training-mode forward pass before precond.step()"
            )
        for name, layer in self.layers.items():
            if name not in self._launched:
                self._reduce_layer(layer, decay)
        self._launched.clear()
        self.comm.wait()

    # decompose → broadcast ------------------------------------------------------
    def _update_second_order(self, damping: float) -> None:
        cfg = self.config
        method = ComputeMethod(cfg.compute_method)
        rank = self.rank
        pis = self._pi_splits() if method is ComputeMethod.INVERSE else {}
        for name, layer in self.layers.items():
            if not layer.captured:
                continue
            lp = self.plan.layer(name)
            do_a = lp.a_decomposer == rank and layer.stats.A is not None
            do_g = lp.g_decomposer == rank and layer.stats.G is not None
            if do_a or do_g:
                ok = layer.decompose(
                    method,
                    damping,
                    cfg.compute_eigenvalue_outer_product and lp.colocated,
                    do_a=do_a,
                    do_g=do_g,
                    pi=pis.get(name),
                )
                if not ok:
                    logger.warning("decomposition of %s failed; keeping the previous one", name)
            self._broadcast_second_order(layer, lp, method)
        self.comm.wait()
        if method is ComputeMethod.EIGEN and cfg.compute_eigenvalue_outer_product:
            for name, layer in self.layers.items():
                if not self.plan.layer(name).colocated:
                    layer.finish_outer_product(damping)
        self._drop_unowned_second_order()
        self._stale_second_order = False

    def _pi_splits(self) -> dict[str, Tensor]:
        """π for every layer; traces are exchanged when A and G live on different ranks."""
        pis: dict[str, Tensor] = {}
        if not self.comm.distributed or self.plan.colocate_factors:
            for name, layer in self.layers.items():
                if layer.stats.A is not None and layer.stats.G is not None:
                    ta, tg = layer.traces()
                    pis[name] = pi_split(ta, layer.adapter.a_dim, tg, layer.adapter.g_dim)
            return pis
        names = list(self.layers)
        # on the layers' device: NCCL reduces GPU tensors only
        device = next(iter(self.layers.values())).adapter.device
        traces = torch.zeros(2 * len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            stats = self.layers[name].stats
            if stats.A is not None:
                traces[2 * i] = torch.trace(stats.A)
            if stats.G is not None:
                traces[2 * i + 1] = torch.trace(stats.G)
        result: list[Tensor] = []
        self.comm.allreduce_sum(traces, result.extend)
        self.comm.wait()
        summed = result[0]
        for i, name in enumerate(names):
            la = self.layers[name].adapter
            pis[name] = pi_split(summed[2 * i], la.a_dim, summed[2 * i + 1], la.g_dim)
        return pis

    def _held_keys(self) -> list[str]:
        """The second-order tensors a gradient worker holds after an update."""
        cfg = self.config
        if cfg.compute_method is ComputeMethod.INVERSE:
            return ["a_inv", "g_inv"]
        if cfg.compute_eigenvalue_outer_product:
            return ["qa", "qg", "inv_outer"]
        return ["qa", "eig_a", "qg", "eig_g"]

    def _sent_keys(self, which: str) -> list[str]:
        """What a decomposer sends: both factors' results ("ag", colocated) or one."""
        if which == "ag":
            return self._held_keys()
        if self.config.compute_method is ComputeMethod.INVERSE:
            return ["a_inv"] if which == "a" else ["g_inv"]
        return ["qa", "eig_a"] if which == "a" else ["qg", "eig_g"]

    def _shape(self, layer: KFACLayer, key: str) -> tuple[int, ...]:
        a, g = layer.adapter.a_dim, layer.adapter.g_dim
        return {
            "qa": (a, a),
            "a_inv": (a, a),
            "eig_a": (a,),
            "qg": (g, g),
            "g_inv": (g, g),
            "eig_g": (g,),
            "inv_outer": (g, a),
        }[key]

    def _broadcast_second_order(
        self, layer: KFACLayer, lp: LayerPlan, method: ComputeMethod
    ) -> None:
        """Decomposer → gradient workers of the layer (COMM-OPT: every rank)."""
        rank = self.rank
        if rank not in lp.grad_workers:
            return
        sources = (
            [("ag", lp.a_decomposer)]
            if lp.colocated
            else [("a", lp.a_decomposer), ("g", lp.g_decomposer)]
        )
        for which, src in sources:
            keys = self._sent_keys(which)
            if rank == src:
                self._ensure_second_order(layer, keys)
                tensors = [layer.second_order[k] for k in keys]
            else:
                tensors = [
                    torch.empty(
                        self._shape(layer, k),
                        dtype=layer.inv_dtype,
                        device=layer.adapter.device,
                    )
                    for k in keys
                ]
            symmetric = [k in ("a_inv", "g_inv") for k in keys]

            def store(received: list[Tensor], keys: list[str] = keys) -> None:
                layer.second_order.update(dict(zip(keys, received)))

            self.comm.broadcast(
                tensors,
                src,
                lp.grad_workers,
                None if rank == src else store,
                symmetric=symmetric,
                kind="second_order_broadcast",
            )

    def _ensure_second_order(self, layer: KFACLayer, keys: list[str]) -> None:
        """A decomposer that never succeeded sends a damping-only preconditioner.

        Identity bases with zero eigenvalues (or ``I/√γ`` inverses) make
        ``V = ∇/γ``; the KL clip bounds the step.  This keeps every rank in
        the same collective even when a factor could not be decomposed.
        """
        for key in keys:
            if key in layer.second_order:
                continue
            shape = self._shape(layer, key)
            dev = layer.adapter.device
            if key in ("qa", "qg"):
                value = torch.eye(shape[0], dtype=layer.inv_dtype, device=dev)
            elif key in ("a_inv", "g_inv"):
                value = torch.eye(shape[0], dtype=layer.inv_dtype, device=dev) / self.damping**0.5
            elif key == "inv_outer":
                value = torch.full(shape, 1.0 / self.damping, dtype=layer.inv_dtype, device=dev)
            else:
                value = torch.zeros(shape, dtype=layer.inv_dtype, device=dev)
            layer.second_order[key] = value

    def _drop_unowned_second_order(self) -> None:
        for name, layer in self.layers.items():
            if self.rank not in self.plan.layer(name).grad_workers:
                layer.second_order.clear()

    # precondition → broadcast → scale → write back ---------------------------------
    def _precondition(self, damping: float) -> None:
        rank = self.rank
        grads: dict[str, Tensor] = {}
        for name, layer in self.layers.items():
            if not layer.captured:
                self._warn_uncaptured(layer)
                continue
            grad = read_grad_matrix(layer.adapter, self.gradient_access)
            if grad is not None:
                grads[name] = grad
        results: dict[str, Tensor] = {}
        for name, grad in grads.items():
            layer = self.layers[name]
            lp = self.plan.layer(name)
            if rank in lp.grad_workers:
                if not layer.ready:
                    self._ensure_second_order(layer, self._held_keys())
                results[name] = layer.precondition(grad, damping)
            if self.plan.grad_workers < self.plan.world_size:
                group = lp.receiver_group_of(rank)
                src = group[0]
                buf = results[name] if rank == src else torch.empty_like(grad)

                def store(received: list[Tensor], name: str = name) -> None:
                    results[name] = received[0]

                self.comm.broadcast(
                    [buf], src, group, None if rank == src else store, kind="grad_broadcast"
                )
        self.comm.wait()
        names = list(results)
        nu = kl_clip_scale(
            [results[n] for n in names], [grads[n] for n in names], self.lr, self.kl_clip
        )
        for name in names:
            value = results[name] if nu is None else results[name].mul_(nu)
            write_grad_matrix(self.layers[name].adapter, self.gradient_access, value)

    def _warn_uncaptured(self, layer: KFACLayer) -> None:
        if layer.name in self._warned:
            return
        self._warned.add(layer.name)
        if read_grad_matrix(layer.adapter, self.gradient_access) is not None:
            warnings.warn(
                f"kaisa: layer {layer.name!r} has a gradient but its hooks never captured "
                "statistics (is it called functionally?); its gradient is left unchanged",
                stacklevel=4,
            )

    # ------------------------------------------------------------------
    # hooks
    def remove_hooks(self) -> None:
        """Take every hook kaisa registered off the model."""
        self.capture.remove()

    def __enter__(self) -> KFACPreconditioner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove_hooks()

    # ------------------------------------------------------------------
    # state
    def state_dict(
        self, include_factors: bool = True, include_second_order: bool = False
    ) -> dict[str, Any]:
        """Steps, non-callable hyperparameters and (by default) the running factors.

        Collective when distributed: every rank must call it, and every rank
        gets the whole state (factors are broadcast from their owners), so
        that a checkpoint taken at any world size and fraction loads into any
        other.  ``include_second_order`` also stores the eigenbases/inverses,
        which makes a resume exact at any step without recomputing them.
        """
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "steps": self.steps,
            "hyperparameters": self.config.hyperparameters(),
        }
        if not (include_factors or include_second_order):
            return state
        layers: dict[str, dict[str, Tensor | None]] = {name: {} for name in self.layers}
        for name, layer in self.layers.items():
            lp = self.plan.layer(name)
            dev = layer.adapter.device
            if include_factors:
                for key, src, dim in (
                    ("A", lp.a_decomposer, lp.a_dim),
                    ("G", lp.g_decomposer, lp.g_dim),
                ):
                    mine = getattr(layer.stats, key) if self.rank == src else None
                    # Whether a factor exists yet is known to its owner only:
                    # send a presence flag after the entries.
                    packed = torch.zeros(dim * dim + 1, dtype=layer.factor_dtype, device=dev)
                    if mine is not None:
                        packed[:-1] = mine.reshape(-1)
                        packed[-1] = 1.0
                    self._gather_into(layers[name], key, packed, src, (dim, dim))
            if include_second_order and layer.captured:
                src = lp.grad_workers[0]
                keys = self._held_keys()
                if self.rank == src:
                    self._ensure_second_order(layer, keys)
                for key in keys:
                    shape = self._shape(layer, key)
                    packed = torch.ones(
                        int(torch.Size(shape).numel()) + 1, dtype=layer.inv_dtype, device=dev
                    )
                    if self.rank == src:
                        packed[:-1] = layer.second_order[key].reshape(-1)
                    self._gather_into(layers[name], key, packed, src, shape)
        self.comm.wait()
        state["layers"] = {
            name: {k: v for k, v in entries.items() if v is not None}
            for name, entries in layers.items()
        }
        return state

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

    def load_state_dict(self, state_dict: Mapping[str, Any], compute_inverses: bool = True) -> None:
        """Restore a :meth:`state_dict` taken at any world size or fraction.

        Each rank keeps only the factors it owns under the current plan and
        only the second-order tensors of layers it is a gradient worker of.
        Without stored second-order tensors they are recomputed by their
        owners (``compute_inverses``; lazily, at the next step, if that step
        does not recompute them anyway).
        """
        if not isinstance(state_dict, Mapping) or "steps" not in state_dict:
            raise ValueError(
                "state_dict must be a mapping produced by KFACPreconditioner.state_dict()"
            )
        steps = state_dict["steps"]
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"state_dict['steps'] must be a non-negative int; got {steps!r}")
        layers = state_dict.get("layers")
        if layers is not None:
            missing = set(self.layers) - set(layers)
            extra = set(layers) - set(self.layers)
            if missing or extra:
                raise ValueError(
                    f"state_dict layers do not match this model: missing {sorted(missing)}, "
                    f"unexpected {sorted(extra)}"
                )
            for name, entry in layers.items():
                self._load_layer(name, entry)
        self._restore_hyperparameters(state_dict.get("hyperparameters", {}))
        self.steps = steps
        self.capture.enabled = self._is_factor_step(self.steps)
        if layers is not None:
            # Decided from the checkpoint itself, which every rank holds whole,
            # so that all ranks agree on whether to run the collective update.
            held = set(self._held_keys())
            complete = all(
                held <= set(entry) for entry in layers.values() if "A" in entry or "G" in entry
            )
            self._stale_second_order = compute_inverses and not complete

    #: schedule hyperparameters a checkpoint restores (as torch.optim restores
    #: its param groups); structural options (method, fraction, dtypes) are not.
    _RESTORED = (
        "factor_update_steps",
        "inv_update_steps",
        "damping",
        "factor_decay",
        "kl_clip",
        "lr",
    )

    def _restore_hyperparameters(self, saved: Mapping[str, Any]) -> None:
        restore = {
            k: saved[k]
            for k in self._RESTORED
            if k in saved
            and not callable(getattr(self.config, k))
            and not (k == "lr" and self._lr_from_optimizer)
        }
        if restore:
            self.config = dataclasses.replace(self.config, **restore)

    def _load_layer(self, name: str, entry: Mapping[str, Tensor]) -> None:
        layer = self.layers[name]
        lp = self.plan.layer(name)
        a, g = layer.adapter.a_dim, layer.adapter.g_dim
        dev = layer.adapter.device
        layer.captured = "A" in entry or "G" in entry
        for key, dim, owner in (("A", a, lp.a_decomposer), ("G", g, lp.g_decomposer)):
            value = entry.get(key)
            if value is not None and tuple(value.shape) != (dim, dim):
                raise ValueError(
                    f"state_dict factor {name}.{key} has shape {tuple(value.shape)}, "
                    f"expected {(dim, dim)}"
                )
            kept = None
            if value is not None and self.rank == owner:
                kept = value.to(dev, layer.factor_dtype).clone()
            setattr(layer.stats, key, kept)
        layer.second_order.clear()
        if self.rank in lp.grad_workers:
            for key in ("qa", "qg", "inv_outer", "eig_a", "eig_g", "a_inv", "g_inv"):
                if key in entry:
                    layer.second_order[key] = entry[key].to(dev, layer.inv_dtype).clone()

    # ------------------------------------------------------------------
    # reporting
    def memory_usage(self) -> dict[str, int]:
        """Bytes held by this rank: factors, batch statistics, second-order tensors."""
        total: dict[str, int] = {"factors": 0, "batch_statistics": 0, "second_order": 0}
        for layer in self.layers.values():
            for key, value in layer.memory().items():
                total[key] += value
        total["total"] = sum(total.values())
        return total

    def comm_stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """Bytes and calls per collective kind: ``{'step': …, 'total': …}``."""
        return self.comm.stats.as_dict()

    def describe(self) -> str:
        """Registration report: what is preconditioned, what is not, and why."""
        lines = [repr(self), "Preconditioned layers:"]
        for name, layer in self.layers.items():
            lp = self.plan.layer(name)
            params = ", ".join(
                f"{name}.{p}" for p in ("weight", "bias")[: 1 + layer.adapter.has_bias]
            )
            lines.append(
                f"  {name:<30} {layer.adapter.describe():<40} [{params}] "
                f"A on rank {lp.a_decomposer}, G on rank {lp.g_decomposer}"
            )
        if self.skipped:
            lines.append("Left to the optimizer alone (not preconditioned):")
            for s in self.skipped:
                lines.append(
                    f"  {s.name or '<root>':<30} {s.kind:<16} {s.reason} "
                    f"[{', '.join(s.parameters)}]"
                )
        return "\n".join(lines)

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"KFACPreconditioner(layers={len(self.layers)}, skipped={len(self.skipped)}, "
            f"compute_method={ComputeMethod(cfg.compute_method).value}, "
            f"factor_update_steps={cfg.factor_update_steps}, "
            f"inv_update_steps={cfg.inv_update_steps}, "
            f"damping={cfg.damping}, factor_decay={cfg.factor_decay}, kl_clip={cfg.kl_clip}, "
            f"world_size={self.plan.world_size}, grad_workers={self.plan.grad_workers}, "
            f"steps={self.steps})"
        )

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Temporarily stop capturing (e.g., for an extra forward in train mode)."""
        previous = self.capture.enabled
        self.capture.enabled = False
        try:
            yield
        finally:
            self.capture.enabled = previous

    @property
    def skipped_modules(self) -> list[SkippedModule]:
        return list(self.skipped)
