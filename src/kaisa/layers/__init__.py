"""Layer adapters: one per module type, mapping it to canonical K-FAC shapes."""

from kaisa.layers.base import LayerAdapter
from kaisa.layers.conv1d import Conv1dAdapter, TransposedLinearAdapter
from kaisa.layers.conv2d import Conv2dAdapter
from kaisa.layers.embedding import EmbeddingAdapter
from kaisa.layers.linear import LinearAdapter
from kaisa.layers.megatron import MegatronLinearAdapter
from kaisa.layers.registry import (
    SkippedModule,
    adapter_for,
    register_layer_type,
    register_layers,
)

__all__ = [
    "Conv1dAdapter",
    "Conv2dAdapter",
    "EmbeddingAdapter",
    "LayerAdapter",
    "LinearAdapter",
    "MegatronLinearAdapter",
    "SkippedModule",
    "TransposedLinearAdapter",
    "adapter_for",
    "register_layer_type",
    "register_layers",
]
