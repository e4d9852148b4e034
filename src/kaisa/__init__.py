"""kaisa: a distributed K-FAC gradient preconditioner for PyTorch."""

from kaisa.allocator import tune_cpu_allocator
from kaisa.config import (
    KFAC_PYTORCH_DEFAULTS,
    AllreduceMethod,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACApprox,
    KFACConfig,
    LossAverage,
)
from kaisa.preconditioner import KFACPreconditioner
from kaisa.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "KFAC_PYTORCH_DEFAULTS",
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KFACApprox",
    "KFACConfig",
    "KFACPreconditioner",
    "LossAverage",
    "Topology",
    "__version__",
    "tune_cpu_allocator",
]
