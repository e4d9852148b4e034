"""The suite's cost cases (:mod:`kaisa_lab.bench.timing`), one module per question.

Importing this package registers every case in
:data:`kaisa_lab.bench.timing.TIMING_CASES`.
"""

from kaisa_lab.bench.costs import (
    breakdown,
    compile_step,
    conv_capture,
    gram,
    launches,
    plan_accuracy,
    plan_paper,
    plan_scale,
    precision,
    scaling,
    stages,
    steps,
    strategies,
    task_steps,
    tensor_parallel,
)

__all__ = [
    "breakdown",
    "compile_step",
    "conv_capture",
    "gram",
    "launches",
    "plan_accuracy",
    "plan_paper",
    "plan_scale",
    "precision",
    "scaling",
    "stages",
    "steps",
    "strategies",
    "task_steps",
    "tensor_parallel",
]
