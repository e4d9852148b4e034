"""Typed, validated configuration of a K-FAC preconditioner.

Every keyword of :class:`kaisa.KFACPreconditioner` that is a plain value (not a
runtime object such as a model, optimizer or grad scaler) lives here, so that
validation happens in one place, before any hook is registered, and so that the
command-line tool can build its options from the same list.

Hyperparameters that kfac-pytorch lets be callables of the K-FAC step
(``factor_update_steps``, ``inv_update_steps``, ``damping``, ``factor_decay``,
``kl_clip``, ``lr``) may be callables here too; their values are checked each
time they are evaluated (:func:`resolve`).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeVar, cast

import torch

__all__ = [
    "KFAC_PYTORCH_DEFAULTS",
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KFACApprox",
    "KFACConfig",
    "LargeFactor",
    "LossAverage",
    "TensorParallelMode",
    "resolve",
]

T = TypeVar("T", int, float)
IntOrSchedule = int | Callable[[int], int]
FloatOrSchedule = float | Callable[[int], float]


class _SameNameEquality:
    """Enum mixin: a member also equals another library's member of the same
    enum class name and member name, so a script that switched only its
    import can keep comparing against ``kfac.enums`` members
    (``precond.compute_method == kfac.enums.ComputeMethod.EIGEN``)."""

    name: str

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and not isinstance(other, type(self)):
            return type(other).__name__ == type(self).__name__ and other.name == self.name
        return bool(super().__eq__(other))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()


class ComputeMethod(_SameNameEquality, str, enum.Enum):
    """How the damped factor inverses are represented.

    ``EIGEN`` eigendecomposes A and G and applies ``(A⊗G + γI)⁻¹`` exactly;
    ``INVERSE`` stores ``(A + π√γ I)⁻¹`` and ``(G + √γ/π I)⁻¹`` (factored
    Tikhonov damping with the π-split of Martens & Grosse 2015), which is
    cheaper to compute but only approximates the same damped matrix.
    ``EKFAC`` divides in the eigenbasis by a running per-example second
    moment instead of the eigenvalues (:mod:`kaisa.methods.ekfac`;
    ``grad_worker_fraction=1`` only).
    """

    EIGEN = "eigen"
    INVERSE = "inverse"
    EKFAC = "ekfac"


class AssignmentStrategy(_SameNameEquality, str, enum.Enum):
    """Cost model used to balance decompositions over ranks: n³ or n²."""

    COMPUTE = "compute"
    MEMORY = "memory"


class DistributedStrategy(_SameNameEquality, enum.Enum):
    """Named gradient-worker fractions of the KAISA paper."""

    COMM_OPT = "comm-opt"  #: f = 1
    HYBRID_OPT = "hybrid-opt"  #: f = 1/2
    MEM_OPT = "mem-opt"  #: f = 1/world_size
    #: chosen at start-up by the planner (:func:`kaisa.planner.forecast.choose_fraction`):
    #: the least predicted overhead within ``memory_budget_mb``
    AUTO = "auto"


class AllreduceMethod(_SameNameEquality, enum.Enum):
    """How factors travel (kfac-pytorch's ``allreduce_method`` attribute):
    bucketed when ``allreduce_bucket_cap_mb`` > 0, one tensor per call at 0."""

    ALLREDUCE = "allreduce"
    ALLREDUCE_BUCKETED = "allreduce-bucketed"


class KFACApprox(str, enum.Enum):
    """How a layer whose weight is shared over positions (tokens, patches) is
    approximated (Eschenhagen et al., NeurIPS 2023).

    * ``EXPAND``: every (data point, position) pair is a row:
      ``A = 1/(N·S) Σ a aᵀ``, ``G = 1/N Σ ĝ ĝᵀ`` over all pairs.
    * ``REDUCE``: positions are reduced per data point first — inputs
      averaged, output gradients summed: ``A = 1/N Σ ā ā ᵀ``,
      ``G = 1/N Σ (Σ_s ĝ)(Σ_s ĝ)ᵀ``; cheaper when S is large.  An Embedding
      keeps EXPAND (a reduced one-hot is not one-hot: A would be dense).
    """

    EXPAND = "expand"
    REDUCE = "reduce"


class TensorParallelMode(str, enum.Enum):
    """How a layer sharded by ``parallelize_module`` (``ColwiseParallel`` /
    ``RowwiseParallel``) is preconditioned (see :mod:`kaisa.engines.tensor_parallel.engine`).

    * ``EXACT``: the factors of the unsharded layer, gathered onto one
      tensor-parallel rank per layer; the preconditioned gradient equals the
      unsharded run's.
    * ``BLOCK``: each rank keeps the factor block of its own shard (A or G
      restricted to the shard's inputs or outputs); no tensor-parallel
      traffic but the KL clip's sum.
    """

    EXACT = "exact"
    BLOCK = "block"


class LargeFactor(str, enum.Enum):
    """What a dense factor larger than ``max_factor_dim`` becomes (:mod:`kaisa.core.blocks`).

    * ``DIAGONAL``: its diagonal, ``d`` entries (kfac-jax's diagonal factor;
      kaisa's tied head's ``G``).  Memory does not grow with ``d`` squared.
    * ``BLOCK``: its diagonal blocks of at most ``max_factor_dim`` rows
      (Distributed Shampoo's ``max_preconditioner_dim``), each decomposed on
      its own: ``≈ d · max_factor_dim`` entries.
    """

    DIAGONAL = "diagonal"
    BLOCK = "block"


#: the largest dense factor by default: 8192 rows are 256 MiB in float32 and
#: about 1.5 GiB with its batch sums, eigenbasis and eigh's workspace, measured
#: (docs/architecture.md, "Large factors"); ResNet-50's 4608-wide and a
#: Llama-7B's 4096-wide factors stay dense, vocabulary-sized ones do not
DEFAULT_MAX_FACTOR_DIM = 8192


class LossAverage(str, enum.Enum):
    """What the training loss was averaged over.

    The output gradients seen by the hooks carry a factor 1/(terms averaged);
    the G factor undoes it so that A⊗G approximates the Fisher of the
    mean-reduced loss independently of the batch size.

    * ``BATCH``: ``loss = mean_n ℓ_n`` (classification; the default).
    * ``BATCH_AND_SEQUENCE``: ``loss = mean_{n,s} ℓ_{n,s}`` (language models
      with ``reduction='mean'`` over all tokens).
    * ``SUM``: ``loss = Σ ℓ``; gradients are used unscaled.
    * ``ITEMS``: ``loss = Σ ℓ / N`` over the whole optimizer step (all its
      micro-batches), with ``N`` — e.g. the number of non-ignored tokens —
      set as ``precond.loss_items`` before the step's backward passes (the
      Hugging Face callback sets it from the Trainer's ``num_items_in_batch``).
    """

    BATCH = "batch"
    BATCH_AND_SEQUENCE = "batch_and_sequence"
    SUM = "sum"
    ITEMS = "items"


_DTYPES = {
    "float64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _as_enum(name: str, value: Any, enum_cls: type[enum.Enum]) -> Any:
    if isinstance(value, enum_cls):
        return value
    allowed = ", ".join(repr(m.value) for m in enum_cls)
    if isinstance(value, enum.Enum):
        # another library's member (kfac-pytorch's ``kfac.enums``) by its name:
        # a script that only switched its import keeps passing its enums
        if value.name in enum_cls.__members__:
            return enum_cls[value.name]
        raise ValueError(
            f"{name} must be one of {allowed} (or an enum member of the same name); got {value!r}"
        )
    if isinstance(value, str):
        for member in enum_cls:
            if value.lower().replace("_", "-") == str(member.value).replace("_", "-"):
                return member
            if value.upper().replace("-", "_") == member.name:
                return member
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


def _as_dtype(name: str, value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if value is not None and not value.is_floating_point:
            raise ValueError(f"{name} must be a floating-point torch.dtype; got {value}")
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise TypeError(
        f"{name} must be None, a floating torch.dtype or one of {sorted(_DTYPES)}; got {value!r}"
    )


#: dtypes the products may run in; float16 is refused (see _as_product_dtype)
_PRODUCT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _as_product_dtype(name: str, value: Any) -> torch.dtype | None:
    """A dtype for ``factor_compute_dtype``/``precondition_dtype``: None,
    float32, float64 or bfloat16.

    float16 is refused because of its range, not its precision: its largest
    value is 65504 and its smallest normal 6e-5, while a preconditioned
    gradient reaches ``|∇|/γ`` (≥ 65504 for ``|∇| ≥ 65`` at γ = 1e-3) and
    output gradients of a mean loss are routinely below 1e-5 (their squares
    far below).  bfloat16 has float32's exponent range and, on CPUs with
    AVX-512 BF16 and on GPUs, faster matrix products.
    """
    try:
        dtype = _as_dtype(name, value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be None, float32, float64 or bfloat16 (a torch.dtype or its name); "
            f"got {value!r}"
        ) from None
    if dtype is not None and dtype not in _PRODUCT_DTYPES:
        raise ValueError(
            f"{name} must be None, float32, float64 or bfloat16; got {dtype} (float16 is "
            "refused: preconditioned gradients and squared output gradients leave its range; "
            "bfloat16 has float32's range)"
        )
    return dtype


def _check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise a ValueError/TypeError naming ``name`` and the allowed range."""
    lo = "-inf" if low is None else str(low)
    hi = "inf" if high is None else str(high)
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    interval = f"{left}{lo}, {hi}{right}"
    kind = "an int" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float) if not integer else int):
        raise TypeError(f"{name} must be {kind} in {interval}; got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite and in {interval}; got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be in {interval}; got {value!r}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be in {interval}; got {value!r}")


# name -> keyword arguments of _check_number, shared by __post_init__ and resolve()
_RANGES: dict[str, dict[str, Any]] = {
    "factor_update_steps": {"low": 1, "integer": True},
    "inv_update_steps": {"low": 1, "integer": True},
    "damping": {"low": 0.0, "low_open": True},
    "factor_decay": {"low": 0.0, "high": 1.0, "low_open": True},
    "kl_clip": {"low": 0.0, "low_open": True},
    "lr": {"low": 0.0},
}


#: what a callable may return beyond a constant's range: a ``factor_decay``
#: schedule returning 0 at the first steps (kfac-pytorch's
#: ``exp_decay_factor_averaging``) means "take the batch's statistics"
_CALLABLE_RANGES: dict[str, dict[str, Any]] = {
    **_RANGES,
    "factor_decay": {"low": 0.0, "high": 1.0},
}


def resolve(name: str, value: Any, step: int) -> Any:
    """Evaluate a possibly-callable hyperparameter at ``step`` and validate it."""
    result = value(step) if callable(value) else value
    if name == "kl_clip" and result is None:
        return None
    if callable(value) and name in _CALLABLE_RANGES:
        _check_number(f"{name}({step})", result, **_CALLABLE_RANGES[name])
    elif name in _RANGES:
        _check_number(name, result, **_RANGES[name])
    return result


def check_value(name: str, value: Any) -> None:
    """Validate a schedule option's new value (a number in range, or a callable)."""
    if callable(value) or (name == "kl_clip" and value is None):
        return
    _check_number(name, value, **_RANGES[name])


#: kfac-pytorch's defaults where kaisa's differ: ``KFACPreconditioner(model,
#: **KFAC_PYTORCH_DEFAULTS)`` behaves as ``kfac.preconditioner.KFACPreconditioner(model)``
#: did (eigen method, every step, γ = 0.001).
KFAC_PYTORCH_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "damping": 0.001,
        "compute_method": "eigen",
    }
)


@dataclass(frozen=True)
class KFACConfig:
    """All plain-value options of :class:`kaisa.KFACPreconditioner`.

    The names and meanings match kfac-pytorch's ``KFACPreconditioner``;
    ``loss_average``, ``kfac_approx`` and ``pg_timeout_s`` are kaisa additions.

    Four defaults differ from kfac-pytorch's (:data:`KFAC_PYTORCH_DEFAULTS`
    restores them): they were chosen from time-to-target sweeps on a ResNet
    and a Transformer and checked on an MLP (docs/results.md).  The inverse
    method with factored damping reached the target on every family and
    seed with one damping; the eigen method needed a damping per family and
    diverged without a KL clip.  Factors every 10 steps and inverses every
    100 cost a few percent of a step; updating every step (kfac-pytorch's
    default) makes a step 2-10x dearer for no fewer steps.  Damping 0.3 is on
    the scale of kaisa's factors, the Fisher of the *mean* loss.
    """

    factor_update_steps: IntOrSchedule = 10
    inv_update_steps: IntOrSchedule = 100
    damping: FloatOrSchedule = 0.3
    factor_decay: FloatOrSchedule = 0.95
    kl_clip: FloatOrSchedule | None = 0.001
    lr: FloatOrSchedule = 0.1
    accumulation_steps: int = 1
    compute_method: ComputeMethod | str = ComputeMethod.INVERSE
    compute_eigenvalue_outer_product: bool = True
    symmetry_aware: bool = False
    grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    allreduce_bucket_cap_mb: float = 25.0
    factor_dtype: torch.dtype | str | None = None
    inv_dtype: torch.dtype | str | None = None
    #: dtype of each batch's Gram product ``rowsᵀ rows`` (dense factors); the
    #: product is cast back and accumulated/stored in ``factor_dtype``.
    #: None: ``factor_dtype`` (no cast)
    factor_compute_dtype: torch.dtype | str | None = None
    #: dtype the preconditioning products run in (``Q_Gᵀ ∇ Q_A``, the divide
    #: and back; ``G⁻¹ ∇ A⁻¹``); the stored tensors keep ``inv_dtype`` and a
    #: cast copy is cached per inverse update.  None: ``inv_dtype`` (no copy)
    precondition_dtype: torch.dtype | str | None = None
    skip_layers: Sequence[str] = field(default_factory=tuple)
    update_factors_in_hook: bool = True
    memory_budget_mb: float | None = None
    #: the cost model ``grad_worker_fraction='auto'`` predicts with: a JSON file
    #: written by ``kaisa plan --save-costs`` (e.g. measured on one of the
    #: cluster's GPUs with ``--measure-costs cuda``); None: the default figures
    plan_costs: str | None = None
    loss_average: LossAverage | str = LossAverage.BATCH
    kfac_approx: KFACApprox | str = KFACApprox.EXPAND
    tensor_parallel: TensorParallelMode | str = TensorParallelMode.EXACT
    #: a dense factor with more rows than this is kept as ``large_factor`` says
    #: (:mod:`kaisa.core.blocks`); None: every factor stays dense, however large
    max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM
    large_factor: LargeFactor | str = LargeFactor.DIAGONAL

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise in place once
        for name in _RANGES:
            value = getattr(self, name)
            if name == "kl_clip" and value is None:
                continue
            if not callable(value):
                _check_number(name, value, **_RANGES[name])
        _check_number("accumulation_steps", self.accumulation_steps, low=1, integer=True)
        _check_number("allreduce_bucket_cap_mb", self.allreduce_bucket_cap_mb, low=0.0)
        if self.memory_budget_mb is not None:
            _check_number("memory_budget_mb", self.memory_budget_mb, low=0.0, low_open=True)
        if self.plan_costs is not None:
            if not isinstance(self.plan_costs, (str, os.PathLike)):
                raise TypeError(f"plan_costs must be a path or None; got {self.plan_costs!r}")
            set_(self, "plan_costs", os.fspath(self.plan_costs))
        for flag in (
            "compute_eigenvalue_outer_product",
            "symmetry_aware",
            "colocate_factors",
            "update_factors_in_hook",
        ):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool; got {getattr(self, flag)!r}")
        set_(self, "compute_method", _as_enum("compute_method", self.compute_method, ComputeMethod))
        set_(
            self,
            "assignment_strategy",
            _as_enum("assignment_strategy", self.assignment_strategy, AssignmentStrategy),
        )
        set_(self, "loss_average", _as_enum("loss_average", self.loss_average, LossAverage))
        set_(self, "kfac_approx", _as_enum("kfac_approx", self.kfac_approx, KFACApprox))
        set_(
            self,
            "tensor_parallel",
            _as_enum("tensor_parallel", self.tensor_parallel, TensorParallelMode),
        )
        if self.max_factor_dim is not None:
            _check_number("max_factor_dim", self.max_factor_dim, low=1, integer=True)
        set_(self, "large_factor", _as_enum("large_factor", self.large_factor, LargeFactor))
        set_(self, "factor_dtype", _as_dtype("factor_dtype", self.factor_dtype))
        set_(self, "inv_dtype", _as_dtype("inv_dtype", self.inv_dtype))
        for name in ("factor_dtype", "inv_dtype"):
            dt = getattr(self, name)
            if name == "inv_dtype" and dt in (torch.float16, torch.bfloat16):
                raise ValueError(
                    "inv_dtype must be float32 or float64 (eigh/inverse have no half-precision "
                    f"kernels); got {dt}"
                )
        for name in ("factor_compute_dtype", "precondition_dtype"):
            set_(self, name, _as_product_dtype(name, getattr(self, name)))
        fraction = self.grad_worker_fraction
        if isinstance(fraction, (str, enum.Enum)):
            fraction = _as_enum("grad_worker_fraction", fraction, DistributedStrategy)
        elif not isinstance(fraction, DistributedStrategy):
            _check_number("grad_worker_fraction", fraction, low=0.0, high=1.0)
            fraction = float(fraction)
        set_(self, "grad_worker_fraction", fraction)
        skip = self.skip_layers
        if skip is None:
            skip = ()
        elif isinstance(skip, str):
            skip = (skip,)
        if not isinstance(skip, (list, tuple, set, frozenset)) or not all(
            isinstance(s, str) for s in skip
        ):
            raise TypeError(
                f"skip_layers must be a regex string or a list of regex strings; got {skip!r}"
            )
        set_(self, "skip_layers", tuple(skip))

    @property
    def worker_fraction(self) -> DistributedStrategy | float:
        """``grad_worker_fraction`` as normalised by ``__post_init__`` (never a str)."""
        assert not isinstance(self.grad_worker_fraction, str)
        return self.grad_worker_fraction

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def hyperparameters(self) -> dict[str, Any]:
        """The non-callable options, in a form fit for a ``state_dict``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if callable(value):
                continue
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out


def layer_dtypes(config: KFACConfig, weight_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(factor dtype, second-order dtype) of a layer whose weight has ``weight_dtype``:
    at least float32, unless ``factor_dtype``/``inv_dtype`` say otherwise."""
    # normalised to torch.dtype | None by KFACConfig.__post_init__
    factor = cast("torch.dtype | None", config.factor_dtype) or torch.promote_types(
        weight_dtype, torch.float32
    )
    inv = cast("torch.dtype | None", config.inv_dtype) or torch.promote_types(factor, torch.float32)
    return factor, inv
