"""Megatron-core's ``ColumnParallelLinear`` and ``RowParallelLinear``.

Matched by class name (:data:`MEGATRON_LINEARS`), so kaisa never imports
Megatron unless the model holds one of its layers.  Measured on
megatron-core 0.16.1:

* both return ``(output, bias)``: ``bias`` is None unless ``skip_bias_add``,
  where the bias is returned for the caller to add (fused into the next
  op), so the output element's gradient is still the gradient of the
  pre-activation and the bias's gradient arrives as usual;
* inputs are ``[sequence, batch, hidden]`` (:class:`LinearCall`
  ``sequence_first``), weights plain tensors ``[d_out, d_in]`` holding this
  rank's shard: a column layer's output rows (its bias sharded with them),
  a row layer's input columns (its bias full, replicated);
* the sharded dimension is the weight's ``partition_dim`` (0: column, 1:
  row) when ``tensor_model_parallel`` is set — Megatron sets both only when
  it initialises the weight (``perform_initialization``), so the class
  decides otherwise; the full sizes are ``input_size`` / ``output_size``.

Alone (a tensor-parallel size of 1) a layer is an ordinary Linear; sharded,
:mod:`kaisa.engines.tensor_parallel.engine` preconditions it like a
``parallelize_module`` layer (:class:`~kaisa.layers.tensor_parallel.Sharding`).
Settings that change where inputs, outputs or gradients live are refused by
:func:`check_supported`, naming the setting.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kaisa.layers.linear import LinearAdapter, LinearCall
from kaisa.layers.tensor_parallel import Sharding, Style

__all__ = [
    "MEGATRON_LINEARS",
    "MegatronLinearAdapter",
    "check_supported",
    "megatron_kind",
    "megatron_sharding",
    "megatron_tp_group",
]

_COLUMN, _ROW = "ColumnParallelLinear", "RowParallelLinear"
#: (module, class name) of the layers this adapter handles
MEGATRON_LINEARS = frozenset(
    ("megatron.core.tensor_parallel.layers", kind) for kind in (_COLUMN, _ROW)
)


def megatron_kind(module: nn.Module) -> str | None:
    """``"ColumnParallelLinear"`` / ``"RowParallelLinear"`` for those classes
    and their subclasses (by name: Megatron is not imported), else None."""
    for cls in type(module).__mro__:
        if (cls.__module__, cls.__name__) in MEGATRON_LINEARS:
            return cls.__name__
    return None


def megatron_sharding(module: nn.Module) -> Sharding | None:
    """How a Megatron parallel linear is sharded; None where its weight is whole
    (a tensor-parallel size of 1)."""
    kind = megatron_kind(module)
    weight = getattr(module, "weight", None)
    if kind is None or weight is None:
        return None
    full_in, full_out = int(module.input_size), int(module.output_size)  # type: ignore[arg-type]
    if tuple(weight.shape) == (full_out, full_in):
        return None
    dim = -1
    if getattr(weight, "tensor_model_parallel", False):
        dim = getattr(weight, "partition_dim", -1)
    if dim == -1:  # attributes unset (perform_initialization=False): the class says
        dim = 0 if kind == _COLUMN else 1
    styles = {0: Style.COLWISE, 1: Style.ROWWISE}
    if dim not in styles:
        raise NotImplementedError(
            f"kaisa: a Megatron {kind} weight with partition_dim={dim} is not supported "
            "(0: ColumnParallelLinear, 1: RowParallelLinear)"
        )
    return Sharding(styles[dim], full_in, full_out)


def megatron_tp_group(module: nn.Module) -> Any:
    """The layer's tensor-parallel process group: its own ``tp_group``, else
    Megatron's global one (``parallel_state``, imported only here)."""
    group = getattr(module, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _refusals(module: nn.Module) -> list[str]:
    """The settings of ``module`` that kaisa cannot precondition, each with why."""
    config = getattr(module, "config", None)
    out = []
    if getattr(module, "weight", None) is None:
        out.append("skip_weight_param_allocation=True (the weight is passed to forward)")
    if getattr(module, "sequence_parallel", False):
        out.append(
            "sequence_parallel=True (activations and their gradients sharded along the "
            "sequence: kaisa would need their all-gathers)"
        )
    if getattr(module, "gradient_accumulation_fusion", False):
        out.append("gradient_accumulation_fusion=True (the weight gradient goes to main_grad)")
    if hasattr(getattr(module, "weight", None), "main_grad"):
        out.append(
            "a weight with main_grad (Megatron's DistributedDataParallel keeps gradients "
            "there, not in .grad)"
        )
    if getattr(module, "is_expert", False):
        out.append("is_expert=True (mixture-of-experts layers)")
    if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
        out.append("defer_embedding_wgrad_compute=True (the weight gradient is deferred)")
    if megatron_sharding(module) is not None:
        if getattr(module, "gather_output", False):
            out.append("gather_output=True (use gather_output=False, the column → row MLP)")
        if megatron_kind(module) == _ROW and not getattr(module, "input_is_parallel", True):
            out.append("input_is_parallel=False (use input_is_parallel=True after a column layer)")
    return out


def check_supported(name: str, module: nn.Module) -> None:
    """Raise, naming the setting, where kaisa cannot precondition ``module``."""
    refused = _refusals(module)
    if refused:
        raise NotImplementedError(
            f"kaisa: Megatron {megatron_kind(module)} {name!r} is not supported with "
            + "; ".join(refused)
            + f". Leave it to the optimizer with skip_layers=[{name!r}]"
        )


class MegatronLinearAdapter(LinearAdapter):
    """A Megatron parallel linear as the Linear its local weight is:
    ``[s, b, h]`` inputs, ``(output, bias)`` outputs.  Sizes are the local
    weight's, which are the layer's at a tensor-parallel size of 1; a sharded
    layer is handed to the tensor-parallel engine through :meth:`sharding`."""

    call = LinearCall(sequence_first=True, returns_bias=True)

    def __init__(self, name: str, module: nn.Module) -> None:
        check_supported(name, module)
        super().__init__(name, module)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def sharding(self) -> Sharding | None:
        return megatron_sharding(self.module)

    def describe(self) -> str:
        return f"{super().describe()} from Megatron-core: [s, b, h] inputs"
