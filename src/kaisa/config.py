"""Typed, validated configuration of a K-FAC preconditioner.

Every keyword of :class:`kaisa.KFACPreconditioner` that is a plain value (not a
runtime object such as a model, optimizer or grad scaler) lives here, so that
validation happens in one place, before any hook is registered, and so that the
command-line tool can build its options from the same list.

The options are grouped by concern, one frozen dataclass each
(:class:`AlgorithmConfig`, :class:`DistributionConfig`,
:class:`PrecisionConfig`, :class:`PlannerConfig`), as Distributed Shampoo
keeps one config per component; :class:`KFACConfig` is all four at once, the
flat view kfac-pytorch's names live in.  Their fields hold converted values
only, typed exactly, so code reading them needs no casts; the spellings a
user may write (enum names, kfac-pytorch's enums, dtype names, one regex for
a list) are converted at one boundary, :meth:`KFACConfig.from_options`.

Hyperparameters that kfac-pytorch lets be callables of the K-FAC step
(``factor_update_steps``, ``inv_update_steps``, ``damping``, ``factor_decay``,
``kl_clip``, ``lr``) may be callables here too; their values are checked each
time they are evaluated (:func:`resolve`).
"""

from __future__ import annotations

import enum
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import torch

from kaisa.core.options import AssignmentStrategy, LargeFactor, LossAverage, SameNameEquality

__all__ = [
    "KFAC_PYTORCH_DEFAULTS",
    "AlgorithmConfig",
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "DistributionConfig",
    "Grafting",
    "KFACApprox",
    "KFACConfig",
    "LargeFactor",
    "LossAverage",
    "PlannerConfig",
    "PrecisionConfig",
    "TensorParallelMode",
    "plain_number",
    "resolve",
]

IntOrSchedule = int | Callable[[int], int]
FloatOrSchedule = float | Callable[[int], float]


class ComputeMethod(SameNameEquality, str, enum.Enum):
    """How the damped factor inverses are represented.

    ``EIGEN`` eigendecomposes A and G and applies ``(A⊗G + γI)⁻¹`` exactly;
    ``INVERSE`` stores ``(A + π√γ I)⁻¹`` and ``(G + √γ/π I)⁻¹`` (factored
    Tikhonov damping with the π-split of Martens & Grosse 2015), which is
    cheaper to compute but only approximates the same damped matrix.
    ``EKFAC`` divides in the eigenbasis by a running per-example second
    moment instead of the eigenvalues (:mod:`kaisa.methods.ekfac`;
    ``grad_worker_fraction=1`` only).  ``EKFAC_ADAM`` runs Adam in K-FAC's
    eigenbasis — running first and second moments of the rotated gradient,
    carried over at each new basis — the K-FAC analogue of SOAP
    (:mod:`kaisa.methods.ekfac_adam`).
    """

    EIGEN = "eigen"
    INVERSE = "inverse"
    EKFAC = "ekfac"
    EKFAC_ADAM = "ekfac_adam"


class DistributedStrategy(SameNameEquality, enum.Enum):
    """Named gradient-worker fractions of the KAISA paper."""

    COMM_OPT = "comm-opt"  #: f = 1
    HYBRID_OPT = "hybrid-opt"  #: f = 1/2
    MEM_OPT = "mem-opt"  #: f = 1/world_size
    #: chosen at start-up by the planner (:func:`kaisa.planner.forecast.choose_fraction`):
    #: the least predicted overhead within ``memory_budget_mb``
    AUTO = "auto"


class AllreduceMethod(SameNameEquality, enum.Enum):
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


#: the largest dense factor by default: 8192 rows are 256 MiB in float32 and
#: about 1.5 GiB with its batch sums, eigenbasis and eigh's workspace, measured
#: (docs/architecture.md, "Large factors"); ResNet-50's 4608-wide and a
#: Llama-7B's 4096-wide factors stay dense, vocabulary-sized ones do not
DEFAULT_MAX_FACTOR_DIM = 8192


class Grafting(str, enum.Enum):
    """Whose step size K-FAC's direction takes, per layer (``grafting``;
    :mod:`kaisa.methods.grafted`).

    Each layer's preconditioned gradient ``V`` is rescaled to the Frobenius
    norm of the grafting method's direction ``D(∇)`` of the same layer's
    gradient (Distributed Shampoo's grafting): K-FAC chooses the direction,
    the grafting method the length.

    * ``SGD``: ``D = ∇``.
    * ``ADAM``: ``D = ∇ / (√v̂ + ε)``, ``v`` an exponential moving average of
      ``∇²`` kept per layer (β₂ = 0.999, ε = 1e-8, bias-corrected).
    """

    SGD = "sgd"
    ADAM = "adam"


_DTYPES = {
    "float64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

#: dtypes factors and second-order tensors may be kept in (float8 has no
#: arithmetic for the running averages; factor_dtype refuses float16 for
#: its range, inv_dtype both 16-bit ones for want of eigh/inverse kernels)
_STORAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: dtypes the products may run in; float16 is refused (see _check_product_dtype)
_PRODUCT_DTYPES = (torch.float32, torch.float64, torch.bfloat16)

#: why a config refuses a name or a list where the boundary takes it
_AT_THE_BOUNDARY = (
    " (names, kfac-pytorch's enums, lists and paths are converted by KFACPreconditioner and "
    "KFACConfig.from_options; the configs themselves hold converted values)"
)


# -- the boundary: what a user may pass, converted to what a config holds ---------------------


def as_enum(name: str, value: Any, enum_cls: type[enum.Enum]) -> Any:
    """``value`` as a member of ``enum_cls``: the member, its value or name in
    any case, or another library's member of the same name; else a
    ``ValueError`` naming ``name`` and the allowed values."""
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


def _dtype_error(name: str, value: Any, *, converted: bool = False) -> TypeError:
    """``converted``: raised by a config, where a dtype's name is not converted."""
    hint = _AT_THE_BOUNDARY if converted and isinstance(value, str) else ""
    if name in ("factor_compute_dtype", "precondition_dtype"):
        return TypeError(
            f"{name} must be None, float32, float64 or bfloat16 (a torch.dtype or its name); "
            f"got {value!r}{hint}"
        )
    return TypeError(
        f"{name} must be None, a floating torch.dtype or one of {sorted(_DTYPES)}; "
        f"got {value!r}{hint}"
    )


def _as_dtype(name: str, value: Any) -> Any:
    """A dtype's name (``'float32'``, ``'torch.bfloat16'``) as the dtype; anything
    else unchanged, for the config to check."""
    if not isinstance(value, str):
        return value
    if value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise _dtype_error(name, value)


#: the options that count something: an integral float (``2.0``) is taken as the int
_COUNTS = frozenset(
    {
        "factor_update_steps",
        "inv_update_steps",
        "accumulation_steps",
        "factor_position_seed",
        "max_factor_dim",
    }
)


def plain_number(name: str, value: Any) -> Any:
    """A numpy scalar as the Python number it holds, and an integral float as
    an int where ``name`` counts something; anything else as given.

    kfac-pytorch takes ``np.int64(10)`` or ``inv_update_steps=2.0`` (its
    options are used, not checked), and a schedule's lambda often returns a
    numpy value; kept as they are, they would be refused by the checks, or
    saved into checkpoints that ``torch.load(weights_only=True)`` refuses."""
    if (
        isinstance(value, numbers.Number)
        and type(value) not in (bool, int, float)  # np.float64 is a float subclass
        and hasattr(value, "item")
    ):
        value = value.item()
    if name in _COUNTS and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def _as_fraction(name: str, value: Any) -> Any:
    """A strategy's name or enum member as a :class:`DistributedStrategy`, a
    number as a float; anything else unchanged, for the config to check."""
    if isinstance(value, (str, enum.Enum)):
        return as_enum(name, value, DistributedStrategy)
    value = plain_number(name, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _as_patterns(name: str, value: Any) -> Any:
    """None, one regex or a collection of regexes as a tuple of regexes."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    return value


def _as_path(name: str, value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _as_grafting(name: str, value: Any) -> Any:
    """``None``, a :class:`Grafting` member, or its name in any case; any
    other string is a ``ValueError`` naming the allowed values."""
    if value is None or isinstance(value, Grafting):
        return value
    converted = as_enum(name, value, Grafting)
    if isinstance(value, str) and not isinstance(converted, Grafting):
        raise ValueError(f"{name} must be None, 'sgd' or 'adam'; got {value!r}")
    return converted


def _enum_of(enum_cls: type[enum.Enum]) -> Callable[[str, Any], Any]:
    return lambda name, value: as_enum(name, value, enum_cls)


#: how :meth:`KFACConfig.from_options` converts each option that has more than
#: one spelling; the others are taken as given (and checked by the configs)
_CONVERTERS: dict[str, Callable[[str, Any], Any]] = {
    "compute_method": _enum_of(ComputeMethod),
    "grafting": _as_grafting,
    "loss_average": _enum_of(LossAverage),
    "kfac_approx": _enum_of(KFACApprox),
    "large_factor": _enum_of(LargeFactor),
    "skip_layers": _as_patterns,
    "grad_worker_fraction": _as_fraction,
    "assignment_strategy": _enum_of(AssignmentStrategy),
    "tensor_parallel": _enum_of(TensorParallelMode),
    "factor_dtype": _as_dtype,
    "inv_dtype": _as_dtype,
    "factor_compute_dtype": _as_dtype,
    "precondition_dtype": _as_dtype,
    "plan_costs": _as_path,
    **{
        name: plain_number
        for name in (
            *_COUNTS,
            "damping",
            "factor_decay",
            "kl_clip",
            "lr",
            "factor_position_fraction",
            "allreduce_bucket_cap_mb",
            "memory_budget_mb",
        )
    },
}


# -- checks of converted values (the configs' __post_init__) ----------------------------------


def check_number(
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


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")


def _check_member(name: str, value: Any, enum_cls: type[enum.Enum]) -> None:
    if not isinstance(value, enum_cls):
        raise TypeError(
            f"{name} must be a kaisa.{enum_cls.__name__} member; got {value!r}{_AT_THE_BOUNDARY}"
        )


def _check_dtype(name: str, value: Any) -> None:
    """None or a floating torch.dtype (``factor_dtype``, ``inv_dtype``)."""
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise _dtype_error(name, value, converted=True)
    if value not in _STORAGE_DTYPES:
        allowed = ", ".join(str(d) for d in _STORAGE_DTYPES)
        raise ValueError(f"{name} must be one of {allowed} (or None); got {value}")


def _check_product_dtype(name: str, value: Any) -> None:
    """None, float32, float64 or bfloat16 (``factor_compute_dtype``, ``precondition_dtype``).

    float16 is refused because of its range, not its precision: its largest
    value is 65504 and its smallest normal 6e-5, while a preconditioned
    gradient reaches ``|∇|/γ`` (≥ 65504 for ``|∇| ≥ 65`` at γ = 1e-3) and
    output gradients of a mean loss are routinely below 1e-5 (their squares
    far below).  bfloat16 has float32's exponent range and, on CPUs with
    AVX-512 BF16 and on GPUs, faster matrix products.
    """
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise _dtype_error(name, value, converted=True)
    if value not in _PRODUCT_DTYPES:
        raise ValueError(
            f"{name} must be None, float32, float64 or bfloat16; got {value} (float16 is "
            "refused: preconditioned gradients and squared output gradients leave its range; "
            "bfloat16 has float32's range)"
        )


# name -> keyword arguments of _check_number, shared by AlgorithmConfig and resolve()
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
    result = plain_number(name, value(step) if callable(value) else value)
    if name == "kl_clip" and result is None:
        return None
    if callable(value) and name in _CALLABLE_RANGES:
        check_number(f"{name}({step})", result, **_CALLABLE_RANGES[name])
    elif name in _RANGES:
        check_number(name, result, **_RANGES[name])
    return result


def check_value(name: str, value: Any) -> None:
    """Validate a schedule option's new value (a number in range, or a callable)."""
    if callable(value) or (name == "kl_clip" and value is None):
        return
    check_number(name, value, **_RANGES[name])


#: kfac-pytorch's defaults where kaisa's differ: ``KFACPreconditioner(model,
#: **KFAC_PYTORCH_DEFAULTS)`` behaves as ``kfac.preconditioner.KFACPreconditioner(model)``
#: did (eigen method, every step, γ = 0.001).
KFAC_PYTORCH_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "damping": 0.001,
        "compute_method": ComputeMethod.EIGEN,
    }
)


# -- the configs ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """What K-FAC computes: schedules, damping, the curvature method, which
    layers and how their factors are approximated.

    Four defaults differ from kfac-pytorch's (:data:`KFAC_PYTORCH_DEFAULTS`
    restores them): they were chosen from time-to-target sweeps on a ResNet
    and a Transformer and checked on an MLP; the benchmark suite measures
    them against every tuned baseline (docs/reports/time-to-target.md).  The
    inverse method with factored damping reached the target on every family
    and seed with one damping; the eigen method needed a damping per family
    and diverged without a KL clip.  Factors every 10 steps and inverses every
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
    compute_method: ComputeMethod = ComputeMethod.INVERSE
    compute_eigenvalue_outer_product: bool = True
    #: regexes (``re.search``) on module names or class names K-FAC leaves alone
    skip_layers: tuple[str, ...] = ()
    update_factors_in_hook: bool = True
    loss_average: LossAverage = LossAverage.BATCH
    kfac_approx: KFACApprox = KFACApprox.EXPAND
    #: each factor statistic of a call with ``T`` positions (a sequence, a
    #: convolution's output positions) read from a random ``⌈f·T⌉`` of them,
    #: the same on every rank (:mod:`kaisa.core.positions`): a factor step's
    #: Grams cost ``f`` of theirs.  None (or 1): every position
    factor_position_fraction: float | None = None
    #: the seed of those draws (with the step, the factor and T); None: 0
    factor_position_seed: int | None = None
    #: a dense factor with more rows than this is kept as ``large_factor`` says
    #: (:mod:`kaisa.core.blocks`); None: every factor stays dense, however large
    max_factor_dim: int | None = DEFAULT_MAX_FACTOR_DIM
    large_factor: LargeFactor = LargeFactor.DIAGONAL
    #: rescale each layer's ``V`` to the norm of this method's direction
    #: (:class:`Grafting`, :mod:`kaisa.methods.grafted`); None: no grafting
    grafting: Grafting | None = None

    def __post_init__(self) -> None:
        for name, limits in _RANGES.items():
            value = getattr(self, name)
            if not (callable(value) or (name == "kl_clip" and value is None)):
                check_number(name, value, **limits)
        check_number("accumulation_steps", self.accumulation_steps, low=1, integer=True)
        for flag in ("compute_eigenvalue_outer_product", "update_factors_in_hook"):
            _check_bool(flag, getattr(self, flag))
        _check_member("compute_method", self.compute_method, ComputeMethod)
        _check_member("loss_average", self.loss_average, LossAverage)
        _check_member("kfac_approx", self.kfac_approx, KFACApprox)
        _check_member("large_factor", self.large_factor, LargeFactor)
        fraction = self.factor_position_fraction
        if fraction is not None:
            check_number("factor_position_fraction", fraction, low=0.0, high=1.0, low_open=True)
        if self.factor_position_seed is not None:
            check_number("factor_position_seed", self.factor_position_seed, low=0, integer=True)
        if fraction is not None and fraction < 1.0 and self.kfac_approx is KFACApprox.REDUCE:
            raise ValueError(
                f"factor_position_fraction={self.factor_position_fraction} cuts the rows of "
                "kfac_approx='expand'; kfac_approx='reduce' already forms one row per data "
                "point. Use factor_position_fraction=1.0 with 'reduce', or kfac_approx='expand'"
            )
        if self.grafting is not None and not isinstance(self.grafting, Grafting):
            raise ValueError(
                f"grafting must be None, 'sgd' or 'adam' (a kaisa.Grafting member here"
                f"{_AT_THE_BOUNDARY}); got {self.grafting!r}"
            )
        if self.max_factor_dim is not None:
            check_number("max_factor_dim", self.max_factor_dim, low=1, integer=True)
        skip = self.skip_layers
        if not (isinstance(skip, tuple) and all(isinstance(s, str) for s in skip)):
            hint = _AT_THE_BOUNDARY if isinstance(skip, (str, list, set, frozenset)) else ""
            raise TypeError(
                f"skip_layers must be a regex string or a list of regex strings; got {skip!r}{hint}"
            )
        for pattern in skip:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"skip_layers contains an invalid regex {pattern!r}: {exc}"
                ) from exc


@dataclass(frozen=True, kw_only=True)
class DistributionConfig:
    """How the work and the traffic are laid out over the ranks (KAISA)."""

    #: f: the fraction of the data-parallel ranks that precondition each layer
    grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT
    assignment_strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    allreduce_bucket_cap_mb: float = 25.0
    symmetry_aware: bool = False
    tensor_parallel: TensorParallelMode = TensorParallelMode.EXACT

    def __post_init__(self) -> None:
        if not isinstance(self.grad_worker_fraction, DistributedStrategy):
            if isinstance(self.grad_worker_fraction, str):
                raise TypeError(
                    "grad_worker_fraction must be a float in [0.0, 1.0] or a "
                    f"kaisa.DistributedStrategy member; got {self.grad_worker_fraction!r}"
                    f"{_AT_THE_BOUNDARY}"
                )
            check_number("grad_worker_fraction", self.grad_worker_fraction, low=0.0, high=1.0)
        _check_member("assignment_strategy", self.assignment_strategy, AssignmentStrategy)
        _check_bool("colocate_factors", self.colocate_factors)
        check_number("allreduce_bucket_cap_mb", self.allreduce_bucket_cap_mb, low=0.0)
        _check_bool("symmetry_aware", self.symmetry_aware)
        _check_member("tensor_parallel", self.tensor_parallel, TensorParallelMode)


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The dtypes factors, decompositions and products are held and computed in."""

    #: dtype of A and G; None: the parameter's dtype, at least float32
    factor_dtype: torch.dtype | None = None
    #: dtype of the decompositions (float32 or float64); None: the factor dtype, at least float32
    inv_dtype: torch.dtype | None = None
    #: dtype of each batch's Gram product ``rowsᵀ rows`` (dense factors); the
    #: product is cast back and accumulated/stored in ``factor_dtype``.
    #: None: ``factor_dtype`` (no cast)
    factor_compute_dtype: torch.dtype | None = None
    #: dtype the preconditioning products run in (``Q_Gᵀ ∇ Q_A``, the divide
    #: and back; ``G⁻¹ ∇ A⁻¹``); the stored tensors keep ``inv_dtype`` and a
    #: cast copy is cached per inverse update.  None: ``inv_dtype`` (no copy)
    precondition_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_dtype("factor_dtype", self.factor_dtype)
        _check_dtype("inv_dtype", self.inv_dtype)
        if self.factor_dtype == torch.float16:
            raise ValueError(
                "factor_dtype must be bfloat16, float32 or float64 (or None); got torch.float16 "
                "(float16 is refused for its range: a factor's batch sums pass its largest "
                "value, 65504, with as many rows, and squared output gradients of a mean loss "
                "fall below its smallest normal, 6e-5; bfloat16 has float32's range)"
            )
        if self.inv_dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                "inv_dtype must be float32 or float64 (eigh/inverse have no half-precision "
                f"kernels); got {self.inv_dtype}"
            )
        _check_product_dtype("factor_compute_dtype", self.factor_compute_dtype)
        _check_product_dtype("precondition_dtype", self.precondition_dtype)


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What ``grad_worker_fraction='auto'`` chooses with (:mod:`kaisa.planner.forecast`)."""

    #: K-FAC memory per rank the chosen fraction must fit in, in MiB (2**20 bytes);
    #: None: no limit
    memory_budget_mb: float | None = None
    #: the cost model ``grad_worker_fraction='auto'`` predicts with: a JSON file
    #: written by ``kaisa plan --save-costs`` (e.g. measured on one of the
    #: cluster's GPUs with ``--measure-costs cuda``); None: the default figures
    plan_costs: str | None = None

    def __post_init__(self) -> None:
        if self.memory_budget_mb is not None:
            check_number("memory_budget_mb", self.memory_budget_mb, low=0.0, low_open=True)
        if self.plan_costs is not None and not isinstance(self.plan_costs, str):
            hint = _AT_THE_BOUNDARY if isinstance(self.plan_costs, os.PathLike) else ""
            raise TypeError(f"plan_costs must be a path or None; got {self.plan_costs!r}{hint}")


#: the configs per concern, in the order KFACConfig lists their fields
CONCERNS: tuple[type, ...] = (AlgorithmConfig, DistributionConfig, PrecisionConfig, PlannerConfig)


# Bases in reverse: a dataclass lists the fields of its last base first, so the
# fields run algorithm, distribution, precision, planner.
@dataclass(frozen=True, kw_only=True)
class KFACConfig(PlannerConfig, PrecisionConfig, DistributionConfig, AlgorithmConfig):
    """All plain-value options of :class:`kaisa.KFACPreconditioner`, flat.

    The names and meanings match kfac-pytorch's ``KFACPreconditioner``;
    ``loss_average``, ``kfac_approx``, ``tensor_parallel``, ``max_factor_dim``,
    ``large_factor``, the product dtypes and the planner's options are kaisa
    additions.  It is each of the per-concern configs at once
    (:class:`AlgorithmConfig`, :class:`DistributionConfig`,
    :class:`PrecisionConfig`, :class:`PlannerConfig`: a function that needs
    one concern takes that type) and is built from them by
    :meth:`from_concerns`.

    Fields hold converted values only (enum members, ``torch.dtype``, numbers
    or callables of the step, a tuple of regexes, a path string), so code that
    reads them needs no casts.  What a user may write — names of enum members
    in any case, kfac-pytorch's enums, dtype names, one regex, a list, a
    ``PathLike`` — is converted at the boundary, :meth:`from_options` (which
    :class:`kaisa.KFACPreconditioner` calls).
    """

    def __post_init__(self) -> None:
        AlgorithmConfig.__post_init__(self)
        DistributionConfig.__post_init__(self)
        PrecisionConfig.__post_init__(self)
        PlannerConfig.__post_init__(self)

    @classmethod
    def from_options(cls, **options: Any) -> KFACConfig:
        """The config of ``KFACPreconditioner(model, **options)``'s plain options.

        Converts every spelling the preconditioner accepts; an option not
        given takes its default.  An unknown name is a ``TypeError`` naming
        it; a bad value a ``ValueError``/``TypeError`` naming the option and
        what it allows."""
        names = cls.field_names()
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; allowed: {sorted(names)}")
        converted = {
            name: _CONVERTERS[name](name, value) if name in _CONVERTERS else value
            for name, value in options.items()
        }
        return cls(**converted)

    @classmethod
    def from_concerns(
        cls,
        algorithm: AlgorithmConfig | None = None,
        distribution: DistributionConfig | None = None,
        precision: PrecisionConfig | None = None,
        planner: PlannerConfig | None = None,
    ) -> KFACConfig:
        """One flat config of the per-concern ones (a concern not given: its defaults)."""
        options: dict[str, Any] = {}
        for part, concern in zip((algorithm, distribution, precision, planner), CONCERNS):
            if part is not None:
                options.update(_values(part, concern))
        return cls(**options)

    @property
    def algorithm(self) -> AlgorithmConfig:
        return AlgorithmConfig(**_values(self, AlgorithmConfig))

    @property
    def distribution(self) -> DistributionConfig:
        return DistributionConfig(**_values(self, DistributionConfig))

    @property
    def precision(self) -> PrecisionConfig:
        return PrecisionConfig(**_values(self, PrecisionConfig))

    @property
    def planner(self) -> PlannerConfig:
        return PlannerConfig(**_values(self, PlannerConfig))

    @property
    def worker_fraction(self) -> DistributedStrategy | float:
        """``grad_worker_fraction`` (the name code before the typed fields used)."""
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


def _values(config: object, concern: type) -> dict[str, Any]:
    """The fields of ``concern`` read from ``config`` (which has them)."""
    return {f.name: getattr(config, f.name) for f in fields(concern)}


def layer_dtypes(
    precision: PrecisionConfig, weight_dtype: torch.dtype
) -> tuple[torch.dtype, torch.dtype]:
    """(factor dtype, second-order dtype) of a layer whose weight has ``weight_dtype``:
    at least float32, unless ``factor_dtype``/``inv_dtype`` say otherwise."""
    factor = precision.factor_dtype or torch.promote_types(weight_dtype, torch.float32)
    inv = precision.inv_dtype or torch.promote_types(factor, torch.float32)
    return factor, inv
