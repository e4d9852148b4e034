"""What a preconditioner tells its user: the registration report and memory."""

from __future__ import annotations

import logging

from kaisa.distributed.plan import WorkPlan
from kaisa.layers.registry import SkippedModule
from kaisa.layers.state import KFACLayer
from kaisa.warn import warn_user

__all__ = ["changes", "describe", "log_registration", "memory_usage", "warn_user"]


def memory_usage(layers: list[KFACLayer], workspace: int = 0, stacked: int = 0) -> dict[str, int]:
    """Bytes held by this rank: factors, batch statistics, second-order
    tensors, the reused product buffers (``workspace``, CPU only) and the
    second-order tensors of layers preconditioned together, stacked
    (``stacked``, :mod:`kaisa.step.batched`: a copy of theirs)."""
    total: dict[str, int] = {"factors": 0, "batch_statistics": 0, "second_order": 0}
    for layer in layers:
        for key, value in layer.memory().items():
            total[key] += value
    total["workspace"] = workspace
    total["stacked"] = stacked
    total["total"] = sum(total.values())
    return total


def describe(
    header: str, layers: list[KFACLayer], skipped: list[SkippedModule], plan: WorkPlan
) -> str:
    """What is preconditioned (and where its factors live), what is not, and why."""
    lines = [header, "Preconditioned layers:"]
    for layer in layers:
        lp = plan.layer(layer.name)
        params = ", ".join(layer.adapter.param_names())
        owners = ", ".join(f"{s.name} on rank {o}" for s, o in zip(layer.factors, lp.owners))
        lines.append(f"  {layer.name:<30} {layer.adapter.describe():<40} [{params}] {owners}")
    limited = _limited(layers)
    if limited:
        limit = layers[0].adapter.max_factor_dim
        lines.append(f"Factors above max_factor_dim={limit}, not kept dense: {', '.join(limited)}")
    if skipped:
        lines.append("Left to the optimizer alone (not preconditioned):")
        for s in skipped:
            lines.append(
                f"  {s.name or '<root>':<30} {s.kind:<16} {s.reason} [{', '.join(s.parameters)}]"
            )
    return "\n".join(lines)


def log_registration(
    logger: logging.Logger,
    level: int,
    header: str,
    layers: list[KFACLayer],
    skipped: list[SkippedModule],
    plan: WorkPlan,
) -> None:
    """The registration report as log records, one a layer (as kfac-pytorch
    logs them, so log filters written for it keep working), one a skipped
    module, then the work plan."""
    if not logger.isEnabledFor(level):
        return
    logger.log(level, "%s", header)
    for layer in layers:
        owners = ", ".join(
            f"{s.name} on rank {o}" for s, o in zip(layer.factors, plan.layer(layer.name).owners)
        )
        described = layer.adapter.describe()
        logger.log(level, 'Registered name="%s": %s; %s', layer.name, described, owners)
    for s in skipped:
        logger.log(level, 'Skipped name="%s" (%s): %s', s.name or "<root>", s.kind, s.reason)
    logger.log(level, "KFAC layer assignments: %s", plan.describe())


def _limited(layers: list[KFACLayer]) -> list[str]:
    """The factors ``max_factor_dim`` made diagonal or blocked, as ``layer.G (label)``."""
    return [
        f"{layer.name}.{spec.name} ({spec.label})"
        for layer in layers
        for spec in layer.adapter.limited_specs()
    ]


def changes(layers: list[KFACLayer], skipped: list[SkippedModule]) -> str | None:
    """What kaisa changed about the user's model of its own accord, as one
    message (None: nothing): supported layers it left out (tied, grouped,
    sharded, ...; :attr:`SkippedModule.changed`) and factors it did not keep
    dense (``max_factor_dim``).  Layers the user skipped, and types K-FAC has
    no factors for, are not changes; :func:`describe` lists those too."""
    parts = []
    left = [s for s in skipped if s.changed]
    if left:
        parts.append(
            "kaisa: not preconditioning "
            + "; ".join(f"{s.name or '<root>'!r} ({s.kind}): {s.reason}" for s in left)
        )
    limited = _limited(layers)
    if limited:
        limit = layers[0].adapter.max_factor_dim
        parts.append(
            f"kaisa: factors above max_factor_dim={limit} are not kept dense: "
            + ", ".join(limited)
            + " (raise max_factor_dim, or choose large_factor, to change this)"
        )
    if not parts:
        return None
    return ". ".join(parts) + ". KFACPreconditioner.describe() lists every layer."
