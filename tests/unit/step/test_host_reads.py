"""A non-factor step reads nothing back to the host where reads are not free.

On CPU kaisa reads ν's terms and the finiteness verdict as numbers (free
there); on an accelerator each read is a synchronisation.  These tests run
the accelerator's rule on CPU (``application.read_scalars = False``) and
count the reads a ``step()`` makes (``aten::_local_scalar_dense``, what
``.item()``, ``float()``, ``bool()`` and ``.tolist()`` dispatch to):

1. a non-factor step makes none, with or without a GradScaler; factor steps
   still read (their reductions and decompositions need the host);
2. the run equals the reading one (float64, ≤ 1e-12);
3. non-finite gradients on a non-factor step are found at the next factor
   step: counted and reported there, no factor or decomposition sees them;
   on a factor step they are skipped exactly as before;
4. a method that changes its state while applying (Adam's moments) keeps
   reading, so a bad step never reaches its state.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from kaisa import KFACPreconditioner

KW: dict[str, Any] = dict(factor_update_steps=3, inv_update_steps=6, damping=0.05, kl_clip=0.01)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def build(reads: bool | None, **kw: Any) -> tuple[nn.Module, KFACPreconditioner]:
    net = model().double()
    precond = KFACPreconditioner(net, **{**KW, **kw})
    precond._parts.pipeline.application.read_scalars = reads
    return net, precond


def backward(net: nn.Module, seed: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 6, generator=g, dtype=torch.float64)
    net.zero_grad()
    (F.cross_entropy(net(x), torch.randint(0, 3, (16,), generator=g)) * scale).backward()


def reads_of(precond: KFACPreconditioner) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        precond.step()
    return Counter(e.name for e in prof.events())["aten::_local_scalar_dense"]


def test_non_factor_steps_read_nothing() -> None:
    net, precond = build(False)
    reads = []
    for seed in range(7):
        backward(net, seed)
        reads.append(reads_of(precond))
    assert [r for i, r in enumerate(reads) if i % 3] == [0, 0, 0, 0]
    assert all(r > 0 for r in reads[::3])  # factor steps read their counts
    other, reading = build(None)
    backward(other, 0)
    reading.step()
    backward(other, 1)
    assert reads_of(reading) > 0  # on CPU ν is read as a number on purpose


def test_with_a_grad_scaler_non_factor_steps_read_nothing() -> None:
    net = model()
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    precond = KFACPreconditioner(net, grad_scaler=scaler, **KW)
    precond._parts.pipeline.application.read_scalars = False
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    reads = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scaler's own skip (step 2) is not reported
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            opt.zero_grad()
            out = net(torch.randn(16, 6, generator=g))
            loss = F.cross_entropy(out, torch.randint(0, 3, (16,), generator=g))
            scaler.scale(loss * (float("inf") if seed == 2 else 1.0)).backward()
            scaler.unscale_(opt)
            reads.append(reads_of(precond))
            scaler.step(opt)
            scaler.update()
    assert reads[1] == reads[2] == reads[4] == 0
    assert precond.nonfinite_steps == 0


def test_not_reading_equals_reading() -> None:
    runs = []
    for reads in (None, False):
        net, precond = build(reads)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for seed in range(8):
            backward(net, seed)
            precond.step()
            opt.step()
        runs.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*runs, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-12


def test_a_bad_non_factor_step_is_found_at_the_next_factor_step() -> None:
    net, precond = build(False)
    backward(net, 0)
    precond.step()  # step 0: factors
    backward(net, 1, scale=float("nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing said yet: nothing was read
        precond.step()  # step 1: the NaN goes through, unread
    assert precond.nonfinite_steps == 0
    backward(net, 2)
    precond.step()  # step 2
    backward(net, 3)
    with pytest.warns(UserWarning, match="stayed on the device until the next factor step"):
        precond.step()  # step 3: a factor step reads the deferred verdicts
    assert precond.nonfinite_steps == 1
    assert precond.state_dict()["steps"] == 4  # the deferred step advanced the count
    for layer in precond.layers.values():
        assert all(r is not None and bool(torch.isfinite(r).all()) for r in layer.running)


def test_a_bad_factor_step_is_still_skipped() -> None:
    net, precond = build(False)
    backward(net, 0)
    precond.step()
    for seed in (1, 2):
        backward(net, seed)
        precond.step()
    before = {n: [r.clone() for r in la.running] for n, la in precond.layers.items()}
    backward(net, 3, scale=float("nan"))
    with pytest.warns(UserWarning, match="skipped 1 step"):
        precond.step()  # step 3 is a factor step: read, and skipped
    assert precond.state_dict()["steps"] == 3
    for name, layer in precond.layers.items():
        for r, b in zip(layer.running, before[name], strict=True):
            assert torch.equal(r, b)


def test_a_method_that_updates_its_state_keeps_reading() -> None:
    net, precond = build(False, compute_method="ekfac_adam")
    backward(net, 0)
    precond.step()
    backward(net, 1)
    assert reads_of(precond) > 0
