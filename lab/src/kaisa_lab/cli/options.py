"""``--kfac-*`` command-line options generated from :class:`kaisa.KFACConfig`.

The options are derived from the dataclass fields and their type hints rather
than written out by hand, so a field added to (or renamed in) the library shows
up in the CLI without an edit here, and a field whose type the CLI cannot parse
fails loudly at start-up instead of silently going missing.

Every value is validated by ``KFACConfig.from_options(**{field: value})``, so
the CLI accepts exactly what the library accepts and reports the library's own
message, prefixed by argparse with the option's name.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kaisa.config import KFACConfig

__all__ = ["KFACOption", "add_kfac_arguments", "kfac_options", "kfac_overrides", "parse_bool"]

PREFIX = "kfac_"

# One line per field for --help; a field missing here still gets an option. Texts
# that say what happens when the option is unset replace the library default.
_HELP: dict[str, str] = {
    "factor_update_steps": "steps between updates of the A and G Kronecker factors",
    "inv_update_steps": "steps between recomputations of the factor eigendecompositions/inverses",
    "damping": "Tikhonov damping added to the curvature",
    "factor_decay": "running-average weight kept by the old factors",
    "kl_clip": "bound of the KL clip on the preconditioned step ('none' disables it)",
    "lr": "learning rate the KL clip assumes (unset: the optimizer's lr)",
    "accumulation_steps": "micro-batches accumulated per optimizer step",
    "compute_method": "how the damped inverse is represented",
    "compute_eigenvalue_outer_product": "precompute the eigenvalue outer product (eigen method)",
    "symmetry_aware": "communicate only the upper triangle of symmetric factors",
    "grad_worker_fraction": "fraction of ranks that precondition each layer's gradient",
    "assignment_strategy": "cost model used to balance decompositions over ranks",
    "colocate_factors": "decompose a layer's A and G on the same rank",
    "allreduce_bucket_cap_mb": "size of the buckets factors are all-reduced in",
    "factor_dtype": "dtype the factors are accumulated in ('none': the parameters' dtype, "
    "at least float32)",
    "inv_dtype": "dtype of the decompositions ('none': the factor dtype, at least float32)",
    "factor_compute_dtype": "dtype of the factors' Gram products, e.g. bfloat16 "
    "('none': the factor dtype)",
    "precondition_dtype": "dtype of the preconditioning products, e.g. bfloat16 "
    "('none': the decompositions' dtype)",
    "skip_layers": "regexes of module names or types that K-FAC leaves alone",
    "update_factors_in_hook": "accumulate factors inside the hooks rather than in step()",
    "memory_budget_mb": "K-FAC memory per rank (MiB) grad_worker_fraction='auto' must fit in",
    "plan_costs": "cost model JSON (kaisa plan --save-costs) grad_worker_fraction='auto' uses",
    "loss_average": "what the training loss is averaged over (unset: the task's)",
    "kfac_approx": "layers shared over positions: 'expand' (every position a row) or 'reduce'",
    "factor_position_fraction": "read each factor from this fraction of a call's positions "
    "(a sequence's, a convolution's outputs): a factor step's Grams cost that fraction "
    "('none': every position)",
    "factor_position_seed": "seed of the positions read, with the step ('none': 0)",
    "tensor_parallel": "layers sharded by parallelize_module: 'exact' (gathered) or 'block'",
    "max_factor_dim": "largest dense factor; a larger one becomes --kfac-large-factor "
    "('none': no limit)",
    "grafting": "rescale each layer's K-FAC step to the norm of this method's step: "
    "'sgd' (the gradient's) or 'adam' (∇/(√v̂+ε)); 'none': no grafting",
    "large_factor": "a factor above --kfac-max-factor-dim: 'diagonal' or 'block' "
    "(diagonal blocks of at most that size)",
}

#: flags named otherwise than their option: memory_budget_mb counts MiB
FLAG_NAMES: dict[str, str] = {"memory_budget_mb": "memory_budget_mib"}

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a batch, a count of epochs or seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def float_at_least(low: float, *, strict: bool) -> Any:
    """A parser of finite numbers above ``low`` (``strict``) or from it on."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
        if not (value > low if strict else value >= low) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(
                f"expected a finite number {'>' if strict else '>='} {low:g}; got {text!r}"
            )
        return value

    parse.__name__ = "number"
    return parse


def finite_number(text: str) -> float:
    """A finite number of either sign (a target value of a metric)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number; got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number; got {text!r}")
    return value


def output_folder(text: str) -> Path:
    """``--out``: a folder, or a path one can be made at — checked when the
    command line is read, not when a finished run writes its results."""
    path = Path(text)
    for where in (path, *path.parents):
        if where.exists():
            if not where.is_dir():
                what = "is a file" if where == path else f"lies under the file {where}"
                raise argparse.ArgumentTypeError(f"{path} {what}; give a folder")
            break
    return path


def parse_bool(text: str) -> bool:
    """Parse true/false, yes/no, on/off, 1/0 (case-insensitive)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")


@dataclass(frozen=True)
class KFACOption:
    """One ``--kfac-*`` option and how to parse its strings."""

    field: str
    parse: Callable[[str], Any]
    metavar: str
    nargs: str | None
    default: Any

    @property
    def flag(self) -> str:
        # kfac_approx is --kfac-approx, not --kfac-kfac-approx; memory is in MiB
        # everywhere on the command line (the option counts 2**20 bytes)
        name = FLAG_NAMES.get(self.field, self.field.removeprefix(PREFIX))
        return "--kfac-" + name.replace("_", "-")

    @property
    def dest(self) -> str:
        return PREFIX + self.field


def _members(hint: Any) -> tuple[Any, ...]:
    """The alternatives of a union hint, minus callables (schedules need Python, not a CLI)."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(m for m in members if typing.get_origin(m) is not collections.abc.Callable)


def _value_parser(name: str, hint: Any) -> tuple[Callable[[str], Any], str]:
    """A string parser for one value of type ``hint`` and the metavar that describes it."""
    members = _members(hint)
    enums = [m for m in members if isinstance(m, type) and issubclass(m, enum.Enum)]
    choices = [str(member.value) for e in enums for member in e]
    accepts_none = type(None) in members
    numeric = [m for m in (int, float) if m in members]
    free_text = torch.dtype in members or (str in members and not enums)
    if members == (bool,):
        return parse_bool, "{true,false}"
    if not (choices or numeric or free_text):
        raise TypeError(
            f"KFACConfig.{name} has type {hint!r}, which kaisa_lab.cli.options cannot parse; "
            "teach _value_parser about it"
        )

    def parse(text: str) -> Any:
        lowered = text.strip().lower()
        if accepts_none and lowered == "none":
            return None
        normalised = lowered.replace("_", "-")
        for choice in choices:
            if normalised == choice.replace("_", "-"):
                return choice
        for kind in numeric:
            try:
                return kind(text)
            except ValueError:
                continue
        if free_text:
            return text
        raise argparse.ArgumentTypeError(
            f"expected {_describe(numeric, choices, accepts_none)}; got {text!r}"
        )

    if choices:
        metavar = "{" + _describe(numeric, choices, accepts_none) + "}"
    elif numeric:
        metavar = _describe(numeric, choices, accepts_none).upper()
    else:
        metavar = "DTYPE" if torch.dtype in members else "TEXT"
    return parse, metavar


def _describe(numeric: Sequence[type], choices: Sequence[str], accepts_none: bool) -> str:
    words = [t.__name__ for t in numeric] + list(choices) + (["none"] if accepts_none else [])
    return ",".join(words)


def _validated(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap ``parse`` so the library itself checks the value (ranges, enum names, dtypes)."""

    def convert(text: str) -> Any:
        value = parse(text)
        try:
            KFACConfig.from_options(**{name: value})
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    # argparse names the type in some messages; keep it readable.
    convert.__name__ = name
    return convert


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def kfac_options() -> list[KFACOption]:
    """One option per :class:`KFACConfig` field, in declaration order."""
    hints = typing.get_type_hints(KFACConfig)
    options = []
    for f in dataclasses.fields(KFACConfig):
        hint = hints[f.name]
        if typing.get_origin(hint) is tuple:  # tuple[str, ...]: several values
            item = typing.get_args(hint)[0]
            parse, metavar, nargs = _value_parser(f.name, item)[0], "VALUE", "*"
        else:
            parse, metavar = _value_parser(f.name, hint)
            nargs = None
        if nargs is None:
            parse = _validated(f.name, parse)
        options.append(KFACOption(f.name, parse, metavar, nargs, _field_default(f)))
    return options


def _show_default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple | list):
        return " ".join(map(str, value)) or "(none)"
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def add_kfac_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``--kfac-*`` option to ``parser`` (in its own argument group).

    Unset options are left out of the namespace (``argparse.SUPPRESS``) rather
    than defaulting to ``None``, because ``None`` is a legitimate value (e.g.
    ``--kfac-kl-clip none``) and :func:`kfac_overrides` must tell what the user
    set from what the task or the library should decide.
    """
    group = parser.add_argument_group(
        "K-FAC options",
        "One option per field of kaisa.KFACConfig. Unset options take the task's "
        "default when it has one, else the library default shown.",
    )
    for option in kfac_options():
        help_text = _HELP.get(option.field, f"KFACConfig.{option.field}")
        if "(unset:" not in help_text:
            help_text += f" (library default: {_show_default(option.default)})"
        group.add_argument(
            option.flag,
            dest=option.dest,
            type=option.parse,
            nargs=option.nargs,
            metavar=option.metavar,
            default=argparse.SUPPRESS,
            help=help_text,
        )


def kfac_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The K-FAC keywords the user set on the command line, by field name."""
    out: dict[str, Any] = {}
    for option in kfac_options():
        if hasattr(args, option.dest):
            value = getattr(args, option.dest)
            out[option.field] = tuple(value) if option.nargs else value
    return out
