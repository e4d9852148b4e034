"""Curvature methods: how running factors become a preconditioner.

:data:`REGISTRY` is the one place a :class:`~kaisa.config.ComputeMethod`
is mapped to its implementation, as ``"module:Class"`` (imported when
selected): adding a method adds its module and one line here.
"""

from __future__ import annotations

import importlib

from kaisa.config import ComputeMethod
from kaisa.methods.base import CurvatureMethod, HeldTensor, Transfer
from kaisa.methods.eigen import EigenMethod
from kaisa.methods.inverse import InverseMethod

__all__ = [
    "REGISTRY",
    "CurvatureMethod",
    "EigenMethod",
    "HeldTensor",
    "InverseMethod",
    "Transfer",
    "method_for",
]

#: ``compute_method`` → the class implementing it
REGISTRY: dict[ComputeMethod, str] = {
    ComputeMethod.EIGEN: "kaisa.methods.eigen:EigenMethod",
    ComputeMethod.INVERSE: "kaisa.methods.inverse:InverseMethod",
    ComputeMethod.EKFAC: "kaisa.methods.ekfac:EKFACMethod",
    ComputeMethod.EKFAC_ADAM: "kaisa.methods.ekfac_adam:EKFACAdamMethod",
}


def method_for(compute_method: ComputeMethod, outer_product: bool) -> CurvatureMethod:
    """The curvature method for a configuration."""
    module, _, name = REGISTRY[ComputeMethod(compute_method)].partition(":")
    cls: type[CurvatureMethod] = getattr(importlib.import_module(module), name)
    return cls.from_options(outer_product=outer_product)
