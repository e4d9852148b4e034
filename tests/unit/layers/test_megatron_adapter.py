"""Megatron-core's parallel linears without Megatron or processes: stand-ins
with the real classes' module path and attributes are matched by name, their
``[s, b, h]`` inputs and ``(output, bias)`` outputs are read correctly, the
sharding comes from ``partition_dim`` (or the class where it is unset), and
unsupported settings are refused by name.  The real layers are exercised in
``tests/distributed/test_megatron.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kaisa.layers.megatron import MegatronLinearAdapter, megatron_sharding
from kaisa.layers.registry import register_layers
from kaisa.layers.tensor_parallel import Sharding, Style


def _megatron_class(kind: str) -> type[nn.Module]:
    class Layer(nn.Module):
        """What ``ColumnParallelLinear`` / ``RowParallelLinear`` hold: local
        shards of a ``[output_size, input_size]`` weight split ``tp`` ways."""

        def __init__(self, d_in: int, d_out: int, tp: int = 1, **settings: Any) -> None:
            super().__init__()
            self.input_size, self.output_size = d_in, d_out
            colwise = kind == "ColumnParallelLinear"
            shape = (d_out // tp, d_in) if colwise else (d_out, d_in // tp)
            self.weight = nn.Parameter(torch.randn(*shape, dtype=torch.float64))
            self.bias = nn.Parameter(torch.zeros(shape[0], dtype=torch.float64))
            self.gather_output, self.input_is_parallel = False, True
            self.skip_bias_add, self.sequence_parallel = True, False
            for name, value in settings.items():
                setattr(self, name, value)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
            return x @ self.weight.t(), self.bias  # skip_bias_add: the bias returned

    Layer.__module__, Layer.__name__ = "megatron.core.tensor_parallel.layers", kind
    return Layer


Column, Row = _megatron_class("ColumnParallelLinear"), _megatron_class("RowParallelLinear")


def test_matched_by_class_name_and_read_as_sequence_first() -> None:
    class Sub(Column):  # type: ignore[misc, valid-type]
        """A subclass (Megatron's own code subclasses these) is matched too."""

    net = nn.Sequential(Sub(4, 6))
    adapters, skipped = register_layers(net)
    assert [type(a) for a in adapters] == [MegatronLinearAdapter] and not skipped
    adapter = adapters[0]
    x = torch.randn(5, 3, 4, dtype=torch.float64)  # [s, b, h]
    rows = adapter.input_rows(x)
    assert rows.shape == (3, 5, 4) and torch.equal(rows[1, 2], x[2, 1])
    assert adapter.batch_size(x) == 3
    output, bias = net[0](x)
    assert adapter.output_tensor((output, bias)) is output
    assert (adapter.in_features, adapter.out_features, adapter.sharding()) == (4, 6, None)


def test_sharding_from_partition_dim_or_the_class() -> None:
    col, row = Column(4, 6, tp=2), Row(4, 6, tp=2)
    assert megatron_sharding(col) == Sharding(Style.COLWISE, 4, 6)
    assert megatron_sharding(row) == Sharding(Style.ROWWISE, 4, 6)
    row.weight.tensor_model_parallel, row.weight.partition_dim = True, 0  # type: ignore[attr-defined]
    assert megatron_sharding(row) == Sharding(Style.COLWISE, 4, 6)  # the attribute wins
    row.weight.partition_dim = 2  # type: ignore[attr-defined]
    with pytest.raises(NotImplementedError, match="partition_dim=2"):
        megatron_sharding(row)


@pytest.mark.parametrize(
    ("layer", "setting"),
    [
        (lambda: Column(4, 6, tp=2, sequence_parallel=True), "sequence_parallel=True"),
        (lambda: Column(4, 6, tp=2, gather_output=True), "gather_output=True"),
        (lambda: Row(4, 6, tp=2, input_is_parallel=False), "input_is_parallel=False"),
        (lambda: Row(4, 6, gradient_accumulation_fusion=True), "gradient_accumulation_fusion"),
        (lambda: Column(4, 6, is_expert=True), "is_expert=True"),
    ],
)
def test_unsupported_settings_are_refused_by_name(layer: Any, setting: str) -> None:
    with pytest.raises(NotImplementedError, match=f"{setting}.*skip_layers"):
        register_layers(nn.Sequential(layer()))
    adapters, skipped = register_layers(nn.Sequential(layer()), skip_layers=["0"])
    assert not adapters and skipped[0].name == "0"


def test_gather_output_is_harmless_unsharded() -> None:
    adapters, _ = register_layers(nn.Sequential(Column(4, 6, gather_output=True)))
    assert len(adapters) == 1
