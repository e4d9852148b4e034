"""Which modules kaisa preconditions, and why the others are left alone.

:func:`register_layers` walks the model once and returns the adapters of the
modules it will precondition plus a :class:`SkippedModule` record for every
module that owns parameters but is not preconditioned, so the registration
report can tell the user exactly which parameters the optimizer sees raw.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from kaisa.layers.attention import attention_adapters
from kaisa.layers.base import LayerAdapter
from kaisa.layers.conv1d import Conv1dAdapter, TransposedLinearAdapter
from kaisa.layers.conv2d import Conv2dAdapter
from kaisa.layers.embedding import EmbeddingAdapter
from kaisa.layers.linear import LinearAdapter, LinearCall, TiedHeadAdapter
from kaisa.layers.megatron import MEGATRON_LINEARS, MegatronLinearAdapter

__all__ = [
    "SkippedModule",
    "adapter_for",
    "register_layer_type",
    "register_layers",
    "supported_layers",
]

AdapterFactory = Callable[[str, nn.Module], LayerAdapter]

# Exact types first; subclasses of these are matched by isinstance afterwards.
_ADAPTERS: dict[type[nn.Module], AdapterFactory] = {
    nn.Linear: LinearAdapter,
    nn.Conv1d: Conv1dAdapter,
    nn.Conv2d: Conv2dAdapter,
    nn.Embedding: EmbeddingAdapter,
}

# Types of optional packages, matched by (module, class name) of the class or
# a base class, so that kaisa never imports them: Hugging Face GPT-2's Conv1D
# is a Linear stored [in, out]; Megatron-core's parallel linears return
# (output, bias) and take [sequence, batch, hidden].
_ADAPTERS_BY_NAME: dict[tuple[str, str], AdapterFactory] = {
    ("transformers.pytorch_utils", "Conv1D"): TransposedLinearAdapter,
    **{key: MegatronLinearAdapter for key in MEGATRON_LINEARS},
}


def _by_name(module: nn.Module) -> AdapterFactory | None:
    for cls in type(module).__mro__:
        factory = _ADAPTERS_BY_NAME.get((cls.__module__, cls.__name__))
        if factory is not None:
            return factory
    return None


def register_layer_type(module_type: type[nn.Module], factory: AdapterFactory) -> None:
    """Teach kaisa a new module type (``factory(name, module) -> LayerAdapter``)."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass; got {module_type!r}")
    _ADAPTERS[module_type] = factory


def supported_layers() -> str:
    """The module types kaisa registers, as a user reads them (the registry's own
    list, so a type added with :func:`register_layer_type` shows too)."""
    names = [f"nn.{t.__name__}" if t.__module__.startswith("torch.") else t.__name__
             for t in _ADAPTERS]  # fmt: skip
    names.append("nn.MultiheadAttention")
    names += sorted({f"{cls} ({module.split('.')[0]})" for module, cls in _ADAPTERS_BY_NAME})
    return ", ".join(names)


@dataclass(frozen=True)
class SkippedModule:
    """A module that owns parameters but is not preconditioned.

    ``changed``: kaisa left it out of its own accord — a supported layer it
    cannot precondition as configured (tied, grouped, sharded) — rather than
    at the user's request (``skip_layers``) or because the type is one K-FAC
    has no factors for (a LayerNorm); such layers are named in a warning."""

    name: str
    kind: str
    reason: str
    parameters: tuple[str, ...]
    changed: bool = False


def _unsupported_reason(module: nn.Module) -> str | None:
    if isinstance(module, nn.Conv1d | nn.Conv2d) and module.groups != 1:
        return (
            f"grouped convolution (groups={module.groups}) is not supported: its Fisher "
            "block is one Kronecker product per group"
        )
    if isinstance(module, nn.Embedding) and module.sparse:
        return (
            "nn.Embedding(sparse=True) gives sparse gradients, which K-FAC cannot "
            "precondition: use sparse=False, or skip_layers to leave it to the optimizer"
        )
    if isinstance(module, nn.Linear | nn.Conv1d | nn.Conv2d) and module.weight is None:
        return "no weight"
    computed = [n for n in ("weight", "bias") if _computed(module, n)]
    if computed:
        return (
            f"{' and '.join(computed)} computed from other parameters (a parametrization, "
            "weight_norm or pruning): K-FAC preconditions a weight's own gradient, and no "
            "parameter holds it; left to the optimizer"
        )
    return None


def _computed(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is a tensor computed on each access (a
    ``torch.nn.utils.parametrize`` parametrization, the old ``weight_norm``,
    ``prune``) rather than a parameter of its own: its gradient is never kept."""
    if parametrize.is_parametrized(module, name):
        return True
    value = getattr(module, name, None)
    return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)


def _known_type(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return True
    return _by_name(module) is not None or isinstance(module, tuple(_ADAPTERS))


def adapter_for(name: str, module: nn.Module) -> tuple[LayerAdapter | None, str | None]:
    """The adapter for ``module``, or ``(None, reason)`` when it cannot be preconditioned."""
    factory = _ADAPTERS.get(type(module)) or _by_name(module)
    if factory is None:
        for module_type, candidate in _ADAPTERS.items():
            if isinstance(module, module_type):
                factory = candidate
                break
    if factory is None:
        return None, f"{type(module).__name__} is not a supported layer type"
    reason = _unsupported_reason(module)
    if reason is not None:
        return None, reason
    return factory(name, module), None


def _direct_params(module: nn.Module, prefix: str) -> tuple[str, ...]:
    return tuple(
        f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)
    )


def _shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    """``id(param) -> qualified names`` for every parameter owned by two or more modules."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(f"{name}.{pname}" if name else pname)
    return {pid: names for pid, names in owners.items() if len(names) > 1}


def register_layers(
    model: nn.Module, skip_layers: Sequence[str] = ()
) -> tuple[list[LayerAdapter], list[SkippedModule]]:
    """Adapters for every supported module of ``model``, in forward-definition order.

    A module is skipped (and reported) when its name or class name matches one
    of ``skip_layers`` (``re.search``), when one of its parameters is tied to
    another module (an Embedding and a Linear head: the summed gradient is not
    the gradient of one Kronecker-factored block), or when its type or
    configuration is not supported.  Frozen layers *are* registered: they are
    preconditioned on the steps where they have a gradient, so gradual
    unfreezing works.
    """
    try:
        patterns = [re.compile(p) for p in skip_layers]
    except re.error as exc:
        raise ValueError(f"skip_layers contains an invalid regex: {exc}") from exc
    # nn.MultiheadAttention applies its projections, out_proj included,
    # functionally: its adapters capture them (kaisa.step.capture.attention), not hooks on out_proj
    attention_of = {
        id(m.out_proj): n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
    }
    registered_attention: set[str] = set()
    sequence_first = _sequence_first_linears(model)
    shared = _shared_parameters(model)
    heads = _tied_heads(model, patterns)  # embedding name -> head name, and back
    adapters: list[LayerAdapter] = []
    skipped: list[SkippedModule] = []
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        kind = type(module).__name__
        params = _direct_params(module, name)
        if id(module) in attention_of:  # its attention's block: matched and told of there
            if attention_of[id(module)] not in registered_attention:
                why = "out_proj of a skipped nn.MultiheadAttention (applied functionally)"
                skipped.append(SkippedModule(name, kind, why, params))
            continue
        matched = _matching(patterns, name, kind)
        if matched is not None:
            skipped.append(SkippedModule(name, kind, f"matches skip_layers {matched!r}", params))
            continue
        if isinstance(module, nn.MultiheadAttention):
            adapters.extend(_attention(name, module, patterns, skipped))
            registered_attention.add(name)
            continue
        ties = [
            f"{pname} tied to {', '.join(n for n in shared[id(p)] if n != mine)}"
            for (pname, p), mine in zip(own, params)
            if id(p) in shared
        ]
        if name in heads and isinstance(module, nn.Linear):
            adapters.append(TiedHeadAdapter(name, module, heads[name]))
            continue
        if name in heads:
            why = (
                f"weight tied to {heads[name]}.weight: preconditioned there, as the output "
                "head (the embedding's own curvature term is left out)"
            )
            # not a change to tell of: the weight is preconditioned, as the head
            skipped.append(SkippedModule(name, kind, why, params))
            continue
        if ties and _known_type(module):
            why = "tied parameter (" + "; ".join(ties) + "): left to the optimizer"
            skipped.append(SkippedModule(name, kind, why, params, changed=True))
            continue
        adapter, reason = adapter_for(name, module)
        if adapter is None:
            if ties:
                reason = f"{reason}; tied parameter (" + "; ".join(ties) + ")"
            # a supported type unsupported here is a change the user is told of
            changed = _known_type(module)
            skipped.append(SkippedModule(name, kind, reason or "unsupported", params, changed))
            continue
        if id(module) in sequence_first and isinstance(adapter, LinearAdapter):
            adapter.call = LinearCall(sequence_first=True)
        adapters.append(adapter)
    return adapters, skipped


def _sequence_first_linears(model: nn.Module) -> set[int]:
    """The feed-forward Linears of torch's transformer layers built with
    ``batch_first=False`` (their default): they see ``[sequence, batch, d]``,
    and the batch dimension sets the gradient multiplier (``loss_average``)
    and K-FAC-reduce's rows.  A layer's attention reads its own flag."""
    layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    return {
        id(linear)
        for m in model.modules()
        if isinstance(m, layers) and not m.self_attn.batch_first
        for linear in (m.linear1, m.linear2)
    }


def _matching(patterns: list[re.Pattern[str]], name: str, kind: str) -> str | None:
    """The first ``skip_layers`` pattern found in a module's name or class name."""
    return next((p.pattern for p in patterns if p.search(name) or p.search(kind)), None)


def _attention(
    name: str, module: nn.MultiheadAttention, patterns: list[re.Pattern[str]], skipped: list
) -> list[LayerAdapter]:
    """The q/k/v/out blocks of an attention module; bias_k/bias_v are reported."""
    blocks: list[LayerAdapter] = []
    kind = type(module.out_proj).__name__
    for adapter in attention_adapters(name, module):
        matched = _matching(patterns, adapter.name, kind) if adapter.role == "out" else None
        if matched is not None:  # out_proj is a module of its own: its name or class
            skipped.append(
                SkippedModule(
                    adapter.name,
                    kind,
                    f"matches skip_layers {matched!r}",
                    tuple(adapter.param_names()),
                )
            )
            continue
        blocks.append(adapter)
    extra = [n for n in ("bias_k", "bias_v") if getattr(module, n, None) is not None]
    if extra:
        names = tuple(f"{name}.{n}" if name else n for n in extra)
        why = "bias_k/bias_v (add_bias_kv) are appended to the keys/values, not a projection"
        skipped.append(SkippedModule(name, "MultiheadAttention", why, names, changed=True))
    return blocks


def _tied_heads(model: nn.Module, patterns: list[re.Pattern[str]]) -> dict[str, str]:
    """Linear heads whose weight is an Embedding's (the usual LM head), both ways."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Linear | nn.Embedding) and isinstance(weight, nn.Parameter):
            owners.setdefault(id(weight), []).append((name, module))
    pairs: dict[str, str] = {}
    for group in owners.values():
        if len(group) != 2:
            continue
        (a, ma), (b, mb) = group
        if isinstance(ma, nn.Linear):
            (a, ma), (b, mb) = (b, mb), (a, ma)
        if not (isinstance(ma, nn.Embedding) and isinstance(mb, nn.Linear)) or ma.sparse:
            continue
        if any(p.search(n) or p.search(type(m).__name__) for p in patterns for n, m in group):
            continue
        pairs[a], pairs[b] = b, a
    return pairs
