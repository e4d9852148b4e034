"""Built-in training tasks of the ``kaisa`` command (see :mod:`kaisa_lab.tasks.registry`)."""

from kaisa_lab.tasks.base import (
    ArrayDataset,
    BatchDataset,
    Defaults,
    EvalSums,
    Metric,
    Task,
    TaskData,
    bits_per_char,
)
from kaisa_lab.tasks.registry import TASKS, get_task, task_names

__all__ = [
    "TASKS",
    "ArrayDataset",
    "BatchDataset",
    "Defaults",
    "EvalSums",
    "Metric",
    "Task",
    "TaskData",
    "bits_per_char",
    "get_task",
    "task_names",
]
