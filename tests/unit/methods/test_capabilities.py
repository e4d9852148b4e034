"""What each method can do beyond ``apply`` (kaisa.methods.capabilities), and
that the step wires exactly those paths: a capability is implemented, not
inherited by a method whose products differ, and asked once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.methods import CurvatureMethod, EigenMethod, InverseMethod
from kaisa.methods.capabilities import (
    ColumnBlockApply,
    StackedApply,
    StatefulApply,
    stacked_apply,
    updates_state,
)
from kaisa.methods.ekfac import EKFACMethod
from kaisa.methods.ekfac_adam import EKFACAdamMethod
from kaisa.methods.grafted import GraftedMethod

#: name → (method, stacked, column blocks, the keys apply() advances)
CASES: dict[str, tuple[CurvatureMethod, bool, bool, frozenset[str]]] = {
    "eigen": (EigenMethod(), True, True, frozenset()),
    "inverse": (InverseMethod(), True, True, frozenset()),
    "ekfac": (EKFACMethod(), False, False, frozenset()),
    "ekfac_adam": (EKFACAdamMethod(), False, False, frozenset({"adam_m", "adam_v", "adam_t"})),
    "ekfac_adam-no-momentum": (
        EKFACAdamMethod(betas=(0.0, 0.95)),
        False,
        False,
        frozenset({"adam_v", "adam_t"}),
    ),
    "grafted-sgd": (GraftedMethod(EigenMethod(), "sgd"), False, False, frozenset()),
    "grafted-adam": (
        GraftedMethod(InverseMethod(), "adam"),
        False,
        False,
        frozenset({"graft_v", "graft_t"}),
    ),
    "grafted-sgd-of-ekfac_adam": (
        GraftedMethod(EKFACAdamMethod(), "sgd"),
        False,
        False,
        frozenset({"adam_m", "adam_v", "adam_t"}),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_method_declares_its_capabilities(name: str) -> None:
    method, stacked, blocks, advanced = CASES[name]
    assert isinstance(method, StackedApply) == stacked
    assert isinstance(method, ColumnBlockApply) == blocks
    keys = method.advanced_keys() if isinstance(method, StatefulApply) else frozenset()
    assert keys == advanced
    assert updates_state(method) == bool(advanced)
    # what apply() advances is held, so checkpointed and broadcast like the rest
    specs = KFACPreconditioner(nn.Linear(3, 2), lr=0.1).layers[""].factors
    assert keys <= {t.key for t in method.held(specs, True)}


def _layers_taken(compute_method: str) -> tuple[list[list[str]], bool]:
    """(the stacked groups, whether the in-place path may write column blocks)
    of a step of three same-shape layers, as wired for ``compute_method``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    precond = KFACPreconditioner(model, compute_method=compute_method, lr=0.1)
    F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 4)).backward()
    precond.step()
    application = precond._parts.pipeline.application
    groups = application.groups.split(list(precond.layers.values()))
    return [[la.name for la in g] for g in groups], application.writes.blocks is not None


@pytest.mark.parametrize(
    ("compute_method", "stacked", "blocks"),
    [("eigen", True, True), ("inverse", True, True), ("ekfac", False, False)],
)
def test_the_step_wires_the_paths_a_method_offers(
    compute_method: str, stacked: bool, blocks: bool
) -> None:
    groups, in_place_blocks = _layers_taken(compute_method)
    assert groups == ([["0", "1", "2"]] if stacked else [])
    assert in_place_blocks == blocks


def test_a_stateful_method_is_handed_its_own_tensors() -> None:
    """precondition_dtype would hand apply() cast copies: refused where apply
    advances state, taken where a wrapper advances none."""
    with pytest.raises(ValueError, match=r"precondition_dtype.*compute_method='ekfac_adam'"):
        KFACPreconditioner(
            nn.Linear(2, 2), compute_method="ekfac_adam", precondition_dtype="bfloat16"
        )
    KFACPreconditioner(nn.Linear(2, 2), grafting="sgd", precondition_dtype="bfloat16", lr=0.1)


class _MomentsInverse(InverseMethod):
    """The inverse method, saying its apply advances a tensor (it does not:
    what is tested is the wiring's rule, not the moments)."""

    def __init__(self, keys: frozenset[str]) -> None:
        self.keys = keys

    def advanced_keys(self) -> frozenset[str]:
        return self.keys


def test_a_method_that_advances_state_is_never_stacked() -> None:
    """A stacked copy of its state would take apply's update, not the layer's
    own: the stacked path is wired only for a method that advances nothing."""
    assert stacked_apply(_MomentsInverse(frozenset({"m"}))) is None
    quiet = _MomentsInverse(frozenset())
    assert stacked_apply(quiet) is quiet
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for keys, grouped in ((frozenset({"m"}), False), (frozenset(), True)):
        precond = KFACPreconditioner(model, method=_MomentsInverse(keys), lr=0.1)
        F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 4)).backward()
        precond.step()
        groups = precond._parts.pipeline.application.groups.split(list(precond.layers.values()))
        assert bool(groups) == grouped
        precond.remove_hooks()
        model.zero_grad()
