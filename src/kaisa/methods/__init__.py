"""Curvature methods: how running factors become a preconditioner.

:data:`REGISTRY` is the one place a :class:`~kaisa.config.ComputeMethod`
is mapped to its implementation, as ``"module:Class"`` (imported when
selected): adding a method adds its module and one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kaisa.config import ComputeMethod
from kaisa.methods.base import CurvatureMethod, HeldTensor, Transfer
from kaisa.methods.eigen import EigenMethod
from kaisa.methods.inverse import InverseMethod

if TYPE_CHECKING:
    from kaisa.config import KFACConfig

__all__ = [
    "REGISTRY",
    "CurvatureMethod",
    "EigenMethod",
    "HeldTensor",
    "InverseMethod",
    "Transfer",
    "method_for",
    "resolve_method",
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


def resolve_method(method: CurvatureMethod | None, config: KFACConfig) -> CurvatureMethod:
    """The method a preconditioner runs: the object given (``method=``), else
    the one ``compute_method`` names; wrapped in
    :class:`kaisa.methods.grafted.GraftedMethod` when ``grafting`` is set.

    The one resolution both the preconditioner and the planner
    (:func:`kaisa.planner.forecast.forecast`) use, so a plan counts the state
    the run will hold."""
    if method is None:
        method = method_for(config.compute_method, config.compute_eigenvalue_outer_product)
    if config.grafting is not None:
        from kaisa.methods.grafted import GraftedMethod

        method = GraftedMethod(method, config.grafting)
    return method
