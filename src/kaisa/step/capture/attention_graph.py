"""``nn.MultiheadAttention`` inside a compiled region: kaisa's own forward.

Eager capture watches ``F.linear`` while the module runs
(:mod:`kaisa.step.capture.attention`).  Dynamo cannot do that: it keeps
``F.multi_head_attention_forward`` as one opaque node of the graph, so the
projections inside it are never seen.  Under ``torch.compile`` the module's
forward hook therefore returns the output of :func:`attention_forward`
instead: the same attention, written with the projections as separate
``F.linear`` calls that pass through the graph capture
(:meth:`~kaisa.step.capture.graph.GraphCapture.wrap_parts`), then
``scaled_dot_product_attention`` (or the explicit softmax when the weights
are asked for), as torch's function does.  The module's own result is then
unused and the compiler drops it; the module's checks on shapes and masks
have already run in it.

Layout: the projections run batch-first (``[N, L, E]``), the shape the eager
capture hands on; a self-attention's q, k and v are one packed product (as in
torch), its input factor formed once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa.layers.state import KFACLayer
from kaisa.step.capture.graph import Parts

__all__ = ["attention_forward", "forward_arguments"]

#: ``nn.MultiheadAttention.forward``'s parameters, in order
_PARAMETERS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)
_DEFAULTS: dict[str, Any] = {
    "key_padding_mask": None,
    "need_weights": True,
    "attn_mask": None,
    "average_attn_weights": True,
    "is_causal": False,
}

#: ``project(parts, x, weight, bias)``: ``F.linear`` whose output feeds ``parts``
Project = Callable[[Parts, Tensor, Tensor, "Tensor | None"], Tensor]


def forward_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (as ``forward`` would bind them)."""
    bound = dict(_DEFAULTS)
    bound.update(zip(_PARAMETERS, args, strict=False))
    bound.update(kwargs)
    return bound


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: not attended) as the additive float mask."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _pad(mask: Tensor | None) -> Tensor | None:
    """One more key position (bias_k or the zero attention), attended."""
    return None if mask is None else F.pad(mask, (0, 1))


def _parts(layers: dict[str, KFACLayer], roles: tuple[str, ...], e: int) -> Parts:
    """The registered layers among ``roles``, each with its columns of a
    packed product (``e`` each, in order) or all of one that is its own."""
    return [
        (layers[r], slice(i * e, (i + 1) * e) if len(roles) > 1 else None)
        for i, r in enumerate(roles)
        if r in layers
    ]


def _projections(
    mha: nn.MultiheadAttention,
    layers: dict[str, KFACLayer],
    project: Project,
    query: Tensor,
    key: Tensor,
    value: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v ``[N, L|S, E]``: packed where the inputs are the same tensor."""
    e = mha.embed_dim
    b = mha.in_proj_bias
    bias = (None, None, None) if b is None else (b[:e], b[e : 2 * e], b[2 * e :])

    def parts(*roles: str) -> Parts:
        return _parts(layers, roles, e)

    if not mha._qkv_same_embed_dim:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        return tuple(  # type: ignore[return-value]
            project(parts(role), x, w, bb)
            for role, x, w, bb in zip("qkv", (query, key, value), weights, bias, strict=True)
        )
    w = mha.in_proj_weight
    if query is key and key is value:
        return project(parts("q", "k", "v"), query, w, b).chunk(3, dim=-1)  # type: ignore[return-value]
    q = project(parts("q"), query, w[:e], bias[0])
    if key is value:
        kv = project(parts("k", "v"), key, w[e:], None if b is None else b[e:])
        k, v = kv.chunk(2, dim=-1)
        return q, k, v
    return (
        q,
        project(parts("k"), key, w[e : 2 * e], bias[1]),
        project(parts("v"), value, w[2 * e :], bias[2]),
    )


def attention_forward(
    mha: nn.MultiheadAttention,
    layers: dict[str, KFACLayer],
    project: Project,
    arguments: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """``mha(**arguments)`` with its projections through ``project``
    (``layers``: the registered ones by role, q, k, v and out)."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    need_weights = bool(arguments["need_weights"])
    is_causal = bool(arguments["is_causal"])
    batched = query.dim() == 3
    if not batched:  # [L, E] -> [1, L, E]
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    elif not mha.batch_first:  # [L, N, E] -> [N, L, E]
        query, key, value = (
            (query.transpose(0, 1),) * 3
            if query is key and key is value
            else (query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
        )
    n, length, e = query.shape
    heads, head_dim = mha.num_heads, e // mha.num_heads
    padding = arguments["key_padding_mask"]
    if padding is not None and not batched:
        padding = padding.unsqueeze(0)
    padding = _float_mask(padding, query.dtype)
    mask = _float_mask(arguments["attn_mask"], query.dtype)
    if is_causal and padding is None and not need_weights:
        mask = None  # the hint alone: attention applies the causal mask itself
    elif padding is not None:
        is_causal = False

    q, k, v = _projections(mha, layers, project, query, key, value)
    if mha.bias_k is not None and mha.bias_v is not None:
        k = torch.cat([k, mha.bias_k.expand(n, 1, e)], dim=1)
        v = torch.cat([v, mha.bias_v.expand(n, 1, e)], dim=1)
        mask, padding = _pad(mask), _pad(padding)

    def split(t: Tensor) -> Tensor:  # [N, S, E] -> [N, H, S, hd]
        return t.reshape(n, t.shape[1], heads, head_dim).transpose(1, 2)

    q, k, v = split(q), split(k), split(v)
    if mha.add_zero_attn:
        zeros = torch.zeros((n, heads, 1, head_dim), dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        mask, padding = _pad(mask), _pad(padding)
    source = k.shape[2]
    if mask is not None:  # [L, S] or [N·H, L, S] -> broadcastable to [N, H, L, S]
        mask = (
            mask.reshape(1, 1, length, source)
            if mask.dim() == 2
            else mask.reshape(n, heads, length, source)
        )
    if padding is not None:
        padding = padding.reshape(n, 1, 1, source)
        mask = padding if mask is None else mask + padding
    dropout = mha.dropout if mha.training else 0.0

    weights: Tensor | None = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / head_dim), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        weights = F.softmax(scores, dim=-1)
        if dropout > 0:  # torch returns the weights after dropout
            weights = F.dropout(weights, p=dropout)
        out = torch.matmul(weights, v)
        if arguments["average_attn_weights"]:
            weights = weights.mean(dim=1)
        if not batched:
            weights = weights.squeeze(0)
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal)
    out = out.transpose(1, 2).reshape(n, length, e)
    out = project(_parts(layers, ("out",), e), out, mha.out_proj.weight, mha.out_proj.bias)
    if not batched:
        return out.squeeze(0), weights
    return (out if mha.batch_first else out.transpose(0, 1)), weights
