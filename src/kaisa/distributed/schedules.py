"""What a ``torch.distributed.pipelining`` schedule is, for
:class:`~kaisa.engines.pipelining.PipeliningEngine` (which then reads the
schedule's own attributes: its stage, micro-batch count and group)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_pipeline_schedule", "is_single_stage_schedule"]


def is_pipeline_schedule(obj: Any) -> bool:
    """True for any ``torch.distributed.pipelining`` schedule."""
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
    except ImportError:  # pragma: no cover - a torch without pipelining
        return False
    return isinstance(obj, _PipelineSchedule)


def is_single_stage_schedule(obj: Any) -> bool:
    """True for a schedule that runs one stage per rank (``ScheduleGPipe``,
    ``Schedule1F1B``), not several or a split backward."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return isinstance(obj, PipelineScheduleSingle)
