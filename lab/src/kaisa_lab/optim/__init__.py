"""The first-order optimizers of the ``kaisa`` command, torch's and today's baselines."""

from kaisa_lab.optim.build import (
    BASELINE_LR,
    EXTRA,
    KFAC_BASES,
    OPTIMIZERS,
    OptionalDependencyError,
    build_optimizer,
    check_available,
)
from kaisa_lab.optim.muon import MuonSplit, MuonWithAdamW, muon_split

__all__ = [
    "BASELINE_LR",
    "EXTRA",
    "KFAC_BASES",
    "OPTIMIZERS",
    "MuonSplit",
    "MuonWithAdamW",
    "OptionalDependencyError",
    "build_optimizer",
    "check_available",
    "muon_split",
]
