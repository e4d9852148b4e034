"""kaisa: a distributed K-FAC gradient preconditioner for PyTorch."""

from kaisa.config import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACConfig,
    LossAverage,
)

__version__ = "0.1.0"

__all__ = [
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KFACConfig",
    "KFACPreconditioner",
    "LossAverage",
    "__version__",
]


def __getattr__(name: str) -> object:
    # Imported lazily so that `import kaisa.config` (used by the CLI's option
    # parser) stays cheap.
    if name == "KFACPreconditioner":
        from kaisa.preconditioner import KFACPreconditioner

        return KFACPreconditioner
    raise AttributeError(name)
