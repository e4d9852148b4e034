"""kaisa: a distributed K-FAC gradient preconditioner for PyTorch."""

from kaisa.allocator import tune_cpu_allocator
from kaisa.config import (
    KFAC_PYTORCH_DEFAULTS,
    AlgorithmConfig,
    AllreduceMethod,
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    DistributionConfig,
    Grafting,
    KFACApprox,
    KFACConfig,
    LargeFactor,
    LossAverage,
    PlannerConfig,
    PrecisionConfig,
    TensorParallelMode,
)
from kaisa.distributed.topology import Topology
from kaisa.preconditioner import KFACPreconditioner

__version__ = "0.1.0"

__all__ = [
    "KFAC_PYTORCH_DEFAULTS",
    "AlgorithmConfig",
    "AllreduceMethod",
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "DistributionConfig",
    "Grafting",
    "KFACApprox",
    "KFACConfig",
    "KFACPreconditioner",
    "LargeFactor",
    "LossAverage",
    "PlannerConfig",
    "PrecisionConfig",
    "TensorParallelMode",
    "Topology",
    "__version__",
    "tune_cpu_allocator",
]
