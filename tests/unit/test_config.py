"""The typed configuration (issue 22, item 5): per-concern configs holding
converted values only, one boundary that converts, and a constructor whose
signature lists every option with the configs' defaults."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import pathlib
import textwrap
import types
import typing

import pytest
import torch
from torch import nn

import kaisa
from kaisa import (
    AlgorithmConfig,
    DistributionConfig,
    KFACConfig,
    KFACPreconditioner,
    PlannerConfig,
    PrecisionConfig,
)
from kaisa.engines.base import EngineDefaults
from kaisa.engines.pytorch import TorchEngine

CONCERNS = (AlgorithmConfig, DistributionConfig, PrecisionConfig, PlannerConfig)
#: options whose constructor default is None, "not given": the engine's value, else the config's
FROM_THE_ENGINE = {"lr", "accumulation_steps"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _constructor_defaults() -> dict[str, object]:
    parameters = inspect.signature(KFACPreconditioner).parameters
    return {name: parameters[name].default for name in KFACConfig.field_names()}


def _check_constructor_defaults() -> None:
    signature = _constructor_defaults()
    config = KFACConfig()
    for name, default in signature.items():
        if name in FROM_THE_ENGINE:
            assert default is None, name
        else:
            assert default == getattr(config, name), name


def test_constructor_lists_every_option_with_the_configs_defaults() -> None:
    assert KFACConfig().damping == 0.3
    _check_constructor_defaults()
    assert KFACPreconditioner(mlp()).config == KFACConfig()
    assert not any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        for p in inspect.signature(KFACPreconditioner).parameters.values()
    )


def test_each_default_is_written_once() -> None:
    """The constructor's signature reads every option's default from the
    config that declares it (``= AlgorithmConfig.damping``), and the CLI's
    ``--kfac-*`` options are generated from the same fields: a default is a
    literal in one place only, so the three cannot drift apart."""
    import ast

    from kaisa_lab.cli.options import kfac_options

    source = inspect.getsource(KFACPreconditioner.__init__)
    init = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(init, ast.FunctionDef)
    names = [a.arg for a in init.args.kwonlyargs]
    owners = {f.name: concern.__name__ for concern in CONCERNS for f in dataclasses.fields(concern)}
    for name, default in zip(names, init.args.kw_defaults, strict=True):
        if name not in owners:
            continue  # a runtime argument, not an option
        if name in FROM_THE_ENGINE:
            assert isinstance(default, ast.Constant) and default.value is None, name
            continue
        assert isinstance(default, ast.Attribute), f"{name}: default written as a literal"
        assert isinstance(default.value, ast.Name), name
        assert (default.value.id, default.attr) == (owners[name], name)
    assert sorted(o.field for o in kfac_options()) == sorted(KFACConfig.field_names())


def test_fields_are_typed_without_strings() -> None:
    """A field holds what code reads: an enum member, a dtype, a number, a
    callable, a tuple of regexes; only ``plan_costs`` (a path) is a str."""
    hints = typing.get_type_hints(KFACConfig)
    for name, hint in hints.items():
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        assert (str in members) == (name == "plan_costs"), (name, hint)


def test_the_getting_started_table_lists_each_concerns_options() -> None:
    """docs/getting-started.md's table of the configs names every option of
    each, and no other (an option added to a config and not to the table fails)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "docs" / "getting-started.md").read_text()
    for concern in CONCERNS:
        rows = [r for r in text.splitlines() if r.startswith(f"| `{concern.__name__}` |")]
        assert len(rows) == 1, concern.__name__
        listed = rows[0].split("|")[2].replace("`", "").split(",")
        assert sorted(n.strip() for n in listed) == sorted(
            f.name for f in dataclasses.fields(concern)
        ), concern.__name__


def test_kfac_config_is_each_concern_and_made_of_them() -> None:
    names = [f.name for concern in CONCERNS for f in dataclasses.fields(concern)]
    assert sorted(names) == sorted(KFACConfig.field_names())  # a partition
    assert len(set(names)) == len(names)
    config = KFACConfig.from_options(
        damping=0.01, grad_worker_fraction=0.5, inv_dtype="float64", memory_budget_mb=64
    )
    assert all(isinstance(config, concern) for concern in CONCERNS)
    parts = (config.algorithm, config.distribution, config.precision, config.planner)
    assert [type(p) for p in parts] == list(CONCERNS)
    assert (parts[0].damping, parts[1].grad_worker_fraction) == (0.01, 0.5)
    assert (parts[2].inv_dtype, parts[3].memory_budget_mb) == (torch.float64, 64)
    assert KFACConfig.from_concerns(*parts) == config
    assert KFACConfig.from_concerns(precision=parts[2]) == KFACConfig(inv_dtype=torch.float64)
    for concern in CONCERNS:
        assert dataclasses.fields(concern)[0].kw_only
        with pytest.raises(dataclasses.FrozenInstanceError):
            concern().__setattr__(dataclasses.fields(concern)[0].name, None)


@pytest.mark.parametrize(
    ("concern", "options", "match"),
    [
        (AlgorithmConfig, {"damping": 0.0}, r"damping must be in \(0"),
        (AlgorithmConfig, {"max_factor_dim": 0}, "max_factor_dim"),
        (DistributionConfig, {"grad_worker_fraction": 1.5}, "grad_worker_fraction"),
        (DistributionConfig, {"allreduce_bucket_cap_mb": -1.0}, "allreduce_bucket_cap_mb"),
        (PrecisionConfig, {"inv_dtype": torch.bfloat16}, "inv_dtype"),
        (PrecisionConfig, {"precondition_dtype": torch.float16}, "precondition_dtype"),
        (PlannerConfig, {"memory_budget_mb": 0.0}, "memory_budget_mb"),
    ],
)
def test_each_concern_checks_its_own_fields(concern: type, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        concern(**options)
    with pytest.raises(ValueError, match=match):
        KFACConfig(**options)


class OtherComputeMethod(enum.Enum):  # as kfac-pytorch's kfac.enums.ComputeMethod
    EIGEN = 1
    INVERSE = 2


@pytest.mark.parametrize(
    ("name", "given", "held"),
    [
        ("compute_method", "EIGEN", kaisa.ComputeMethod.EIGEN),
        ("compute_method", OtherComputeMethod.EIGEN, kaisa.ComputeMethod.EIGEN),
        ("grad_worker_fraction", "hybrid_opt", kaisa.DistributedStrategy.HYBRID_OPT),
        ("grad_worker_fraction", 1, 1.0),
        ("assignment_strategy", "memory", kaisa.AssignmentStrategy.MEMORY),
        ("loss_average", "BATCH_AND_SEQUENCE", kaisa.LossAverage.BATCH_AND_SEQUENCE),
        ("kfac_approx", "reduce", kaisa.KFACApprox.REDUCE),
        ("tensor_parallel", "block", kaisa.config.TensorParallelMode.BLOCK),
        ("large_factor", "block", kaisa.LargeFactor.BLOCK),
        ("factor_dtype", "torch.float64", torch.float64),
        ("precondition_dtype", "bfloat16", torch.bfloat16),
        ("skip_layers", "head", ("head",)),
        ("skip_layers", ["a", "b"], ("a", "b")),
        ("skip_layers", None, ()),
        ("plan_costs", pathlib.Path("/tmp/costs.json"), "/tmp/costs.json"),
    ],
)
def test_the_boundary_converts_and_the_configs_refuse_unconverted(
    name: str, given: object, held: object
) -> None:
    converted = getattr(KFACConfig.from_options(**{name: given}), name)
    assert converted == held and type(converted) is type(held)
    if given is None or type(given) is type(held):
        return  # nothing to convert (None, an int fraction, ...)
    if name == "grad_worker_fraction" and isinstance(given, int):
        return
    with pytest.raises(TypeError, match=rf"{name} .*KFACConfig\.from_options"):
        KFACConfig(**{name: given})


def test_from_options_names_an_unknown_option() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['dampning'\]"):
        KFACConfig.from_options(dampning=0.1)


class Accumulating(TorchEngine):
    """An engine that accumulates 4 micro-batches per step itself (as DeepSpeed)."""

    def defaults(self) -> EngineDefaults:
        return EngineDefaults(accumulation_steps=4)


def test_accumulation_steps_none_takes_the_engines_else_one() -> None:
    assert KFACPreconditioner(mlp(), accumulation_steps=None).accumulation_steps == 1
    assert KFACPreconditioner(mlp(), engine=Accumulating()).accumulation_steps == 4
    assert KFACPreconditioner(mlp(), engine=Accumulating(), accumulation_steps=4).config == (
        KFACPreconditioner(mlp(), engine=Accumulating()).config
    )
    with pytest.raises(ValueError, match=r"accumulation_steps=2 but the .* accumulates 4"):
        KFACPreconditioner(mlp(), engine=Accumulating(), accumulation_steps=2)


def test_an_invalid_skip_layers_regex_is_refused_by_the_config() -> None:
    """At construction, naming the pattern (the command line reports it before
    any setup; it used to surface only when the layers were registered)."""
    with pytest.raises(ValueError, match=r"skip_layers contains an invalid regex '\('"):
        KFACConfig.from_options(skip_layers=["head", "("])
    with pytest.raises(ValueError, match=r"skip_layers contains an invalid regex '\['"):
        AlgorithmConfig(skip_layers=("[",))


def test_numpy_numbers_and_integral_floats_are_taken_as_python_numbers() -> None:
    """kfac-pytorch takes ``np.int64(10)``, ``np.float32(0.01)`` and
    ``inv_update_steps=2.0`` (a schedule's lambda often returns numpy): kaisa
    takes them as the Python numbers they hold, in the constructor, the
    attributes and a callable's result, so a checkpoint still loads with
    ``weights_only=True``; a fractional count is still refused."""
    import io

    import numpy as np
    import torch.nn.functional as F

    model = mlp()
    precond = kaisa.KFACPreconditioner(
        model, factor_update_steps=np.int64(1), inv_update_steps=2.0, accumulation_steps=1.0,
        damping=np.float32(0.25), kl_clip=np.float64(1e-3), lr=np.float32(0.1),
        grad_worker_fraction=np.float32(1.0), factor_decay=lambda step: np.float32(0.9),
        max_factor_dim=np.int32(64),
    )  # fmt: skip
    precond.damping = np.float32(0.5)
    assert type(precond.inv_update_steps) is int and precond.inv_update_steps == 2
    assert type(precond.factor_update_steps) is int and type(precond.damping) is float
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(torch.randn(6, 6)), torch.randint(0, 3, (6,))).backward()
        precond.step()
    saved = precond.state_dict()
    kinds = {type(v) for v in saved["hyperparameters"].values()}
    assert not {k for k in kinds if k.__module__ == "numpy"}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    torch.load(buffer, weights_only=True)  # no numpy scalar to refuse
    with pytest.raises(TypeError, match="inv_update_steps must be an int"):
        kaisa.KFACPreconditioner(mlp(), inv_update_steps=2.5)


def test_numpy_numbers_are_taken_where_the_preconditioner_reads_a_number_at_run_time() -> None:
    """``precond._steps`` (kfac-pytorch's scheduler sets it), ``loss_items``
    and a callable ``grad_scaler``'s scale take numpy scalars as numbers, and
    hold them as Python numbers."""
    import numpy as np
    import torch.nn.functional as F

    model = mlp()
    precond = kaisa.KFACPreconditioner(
        model, lr=0.1, loss_average="items", grad_scaler=lambda: np.float32(4.0)
    )
    precond._steps = np.int64(10)  # a factor step: the scale is read
    assert type(precond.steps) is int and precond.steps == 10
    precond.loss_items = np.int64(6)
    model.zero_grad()
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    (F.cross_entropy(model(x), y, reduction="sum") / 6 * 4.0).backward()
    precond.step()  # reads the numpy scale
    assert precond.steps == 11
