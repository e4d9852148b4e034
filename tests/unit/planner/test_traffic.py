"""One model of traffic: the forecast reads the messages the step's phases declare.

The reduction lays its buckets out with :func:`kaisa.distributed.messages.statistic_numel`,
the gradient broadcast sends :func:`kaisa.distributed.messages.grad_message`, a
second-order broadcast sends the method's declared transfer; the forecast
counts exactly those, so a change to what the step sends moves the forecast
with it (and ``tests/distributed/test_forecast_matches_runs.py`` checks both
against real runs' ``comm_stats``).
"""

from __future__ import annotations

import pytest
from torch import nn

from kaisa import KFACPreconditioner
from kaisa.distributed import messages
from kaisa.distributed.messages import Part
from kaisa.planner.forecast import forecast, layer_costs


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 3)
    )


@pytest.mark.parametrize("symmetry_aware", [False, True])
def test_the_forecast_reduces_what_the_reduction_lays_out(symmetry_aware: bool) -> None:
    net = model()
    precond = KFACPreconditioner(net, symmetry_aware=symmetry_aware)
    buckets = precond._parts.pipeline.reduction._buckets
    laid = sum(b.numel * b.dtype.itemsize for b in buckets)
    fc = forecast(layer_costs(net), 2, symmetry_aware=symmetry_aware)  # W=1 sends nothing
    sent = fc.bytes_factor_step["factor_reduce"] + fc.bytes_factor_step["statistic_allreduce"]
    assert laid == int(sent.max()) > 0
    n_statistics = sum(len(la.statistics) for la in precond.layers.values())
    counts = fc.bytes_factor_step["factor_counts"].max()
    assert counts == n_statistics * messages.COUNT_DTYPE.itemsize


def test_the_forecast_follows_the_step_when_a_message_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = layer_costs(model())
    before = forecast(layers, 4, grad_worker_fraction=0.25)
    real = messages.grad_message

    def with_extra(shape):  # a hypothetical third part of 7 elements
        return (*real(shape), Part((7,)))

    monkeypatch.setattr(messages, "grad_message", with_extra)
    monkeypatch.setattr(messages, "statistic_numel", lambda stat, sym: 2)
    after = forecast(layers, 4, grad_worker_fraction=0.25)
    grad = after.bytes_every_step["grad_broadcast"] - before.bytes_every_step["grad_broadcast"]
    assert grad.max() == 7 * 4 * len(layers)  # float32 gradients
    n_factors = sum(len(la.factors) for la in layers)
    assert after.bytes_factor_step["factor_reduce"].max() == 2 * 4 * n_factors
