"""Curvature methods: how running factors become a preconditioner.

:func:`method_for` is the one place a :class:`~kaisa.config.ComputeMethod`
is mapped to its implementation.
"""

from __future__ import annotations

from kaisa.config import ComputeMethod
from kaisa.methods.base import CurvatureMethod, HeldTensor, Transfer
from kaisa.methods.eigen import EigenMethod
from kaisa.methods.inverse import InverseMethod

__all__ = [
    "CurvatureMethod",
    "EigenMethod",
    "HeldTensor",
    "InverseMethod",
    "Transfer",
    "method_for",
]


def method_for(compute_method: ComputeMethod, outer_product: bool) -> CurvatureMethod:
    """The curvature method for a configuration."""
    if compute_method is ComputeMethod.EIGEN:
        return EigenMethod(outer_product=outer_product)
    return InverseMethod()
