"""``nn.MultiheadAttention``: four K-FAC blocks, q, k, v and out.

The module applies its projections functionally
(``F.multi_head_attention_forward``), so no module hook sees them; the
functional capture (:mod:`kaisa.step.capture.attention`) observes each ``F.linear`` call
made with these weights instead and hands over inputs and output gradients
already in the canonical ``[batch, shared, features]`` shape.

The packed ``in_proj_weight`` ``[3E, d]`` holds three projections whose
inputs differ in cross-attention (query vs key/value), so each is its own
block: rows ``[0, E)`` (q), ``[E, 2E)`` (k), ``[2E, 3E)`` (v), each with its
own input factor and its own output-gradient factor.  With ``kdim``/``vdim``
the weights are separate tensors and the packed ``in_proj_bias`` still holds
the three biases.  ``out_proj`` is a fourth block.  ``bias_k``/``bias_v``
(``add_bias_kv``) are left to the optimizer.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

from kaisa.layers.base import describe_specs, trained
from kaisa.layers.linear import LinearAdapter

__all__ = ["ROLES", "ProjectionAdapter", "attention_adapters"]

ROLES = ("q", "k", "v", "out")


class ProjectionAdapter(LinearAdapter):
    """One projection of an ``nn.MultiheadAttention`` (``role``: q, k, v or out)."""

    def __init__(self, name: str, attention: nn.MultiheadAttention, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}; got {role!r}")
        super().__init__(name, attention)
        self.attention = attention
        self.role = role
        self.index = ROLES.index(role)
        self.has_bias = trained(self.bias)

    @property
    def captured_by_module_hooks(self) -> bool:
        return False

    @property
    def weight(self) -> nn.Parameter:
        mha = self.attention
        if self.role == "out":
            return cast(nn.Parameter, mha.out_proj.weight)
        if mha._qkv_same_embed_dim:
            return mha.in_proj_weight
        return cast(nn.Parameter, getattr(mha, f"{self.role}_proj_weight"))

    @property
    def bias(self) -> nn.Parameter | None:
        mha = self.attention
        if self.role == "out":
            return cast("nn.Parameter | None", mha.out_proj.bias)
        return cast("nn.Parameter | None", mha.in_proj_bias)

    @property
    def in_features(self) -> int:
        mha = self.attention
        return int(
            {"q": mha.embed_dim, "k": mha.kdim, "v": mha.vdim, "out": mha.embed_dim}[self.role]
        )

    @property
    def out_features(self) -> int:
        return int(self.attention.embed_dim)

    def _rows(self) -> slice:
        e = self.attention.embed_dim
        return slice(self.index * e, (self.index + 1) * e)

    def param_rows(self) -> list[slice | None]:
        if self.role == "out":
            return [None] * len(self.parameters())
        weight_rows = self._rows() if self.attention._qkv_same_embed_dim else None
        return [weight_rows] + ([self._rows()] if self.has_bias else [])

    def param_names(self) -> list[str]:
        if self.role == "out":
            return super().param_names()
        rows = self._rows()
        span = f"[{rows.start}:{rows.stop}]"
        prefix = self.name.rsplit(".", 1)[0] if "." in self.name else ""
        prefix = f"{prefix}." if prefix else ""
        if self.attention._qkv_same_embed_dim:
            names = [f"{prefix}in_proj_weight{span}"]
        else:
            names = [f"{prefix}{self.role}_proj_weight"]
        return names + ([f"{prefix}in_proj_bias{span}"] if self.has_bias else [])

    def matrix_to_grads(self, mat: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.has_bias:
            return mat[:, :-1], mat[:, -1]
        return mat, None

    def describe(self) -> str:
        return f"MultiheadAttention.{self.role}({describe_specs(self.effective_specs())})"


def attention_adapters(name: str, attention: nn.MultiheadAttention) -> list[ProjectionAdapter]:
    """The four blocks of one attention module, named ``<name>.q/.k/.v`` and
    ``<name>.out_proj`` (the real submodule's name)."""
    prefix = f"{name}." if name else ""
    return [
        ProjectionAdapter(f"{prefix}{'out_proj' if role == 'out' else role}", attention, role)
        for role in ROLES
    ]
