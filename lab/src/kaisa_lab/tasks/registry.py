"""Name → task lookup, the single list of built-in tasks the CLI offers."""

from __future__ import annotations

from kaisa_lab.tasks.autoencoder import DigitsAutoencoderTask
from kaisa_lab.tasks.base import Task
from kaisa_lab.tasks.cifar import Cifar10Task
from kaisa_lab.tasks.digits import DigitsCNNTask, DigitsMLPTask
from kaisa_lab.tasks.text import TextConvTask, TextLMLargeTask, TextLMTask

__all__ = ["TASKS", "get_task", "task_names"]

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        DigitsMLPTask,
        DigitsCNNTask,
        TextLMTask,
        Cifar10Task,
        DigitsAutoencoderTask,
        TextConvTask,
        TextLMLargeTask,
    )
}


def task_names() -> list[str]:
    """Names of the built-in tasks, in the order they are documented."""
    return list(TASKS)


def get_task(name: str) -> Task:
    """A fresh instance of the task called ``name``; KeyError lists the valid names."""
    try:
        return TASKS[name]()
    except KeyError:
        raise KeyError(f"unknown task {name!r}; choose from {', '.join(TASKS)}") from None
