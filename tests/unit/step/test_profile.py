"""The step's own profile (kaisa.step.profile): what it times, and that it changes nothing.

1. Attaching a profile changes no computed value: the preconditioned
   gradients are bit-identical with and without it, over factor, inverse and
   non-factor steps, for the eigen and inverse methods, on a model whose
   layers take every application path (stacked groups, a layer written in
   place in the workspace, layers held until ν, a convolution and an
   embedding).
2. Its exclusive stages add up to ``step`` plus ``capture``, and ``step``
   is about the ``step()`` time measured from outside.
3. Detached, nothing is recorded.
4. Each step's path is kept (factor, non-factor, skipped, replayed), and
   the operations say what each phase worked on.
5. The switches the profile's users need: the capture hooks off and back
   on, stacking off, the accelerator's rule for host reads.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.step.profile import (
    APPLY,
    CAPTURE,
    DECOMPOSE,
    FACTOR,
    FOLD,
    NON_FACTOR,
    PRODUCTS,
    REDUCE,
    REPLAYED,
    SKIPPED,
    STEP,
    StepProfile,
    term_phase,
)

KW: dict[str, Any] = dict(factor_update_steps=2, inv_update_steps=4, damping=0.1, kl_clip=0.01)


class Net(nn.Module):
    """An embedding, a convolution, a stacked group (3 × 24→24), a layer
    large enough for the in-place workspace (≥ 128 KiB) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.conv = nn.Conv1d(8, 24, 3, padding=1)
        self.tower = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(24, 24), nn.Tanh())])
        self.wide = nn.Linear(24, 1400)
        self.head = nn.Linear(1400, 5)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.conv(self.embed(ids).transpose(1, 2)).mean(2)
        return self.head(torch.tanh(self.wide(self.tower(x))))


def batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 10, (6, 7), generator=g), torch.randint(0, 5, (6,), generator=g)


def train_step(model: nn.Module, precond: KFACPreconditioner, step: int) -> list[Tensor]:
    x, y = batch(step)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    precond.step()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_attaching_a_profile_changes_no_gradient(method: str) -> None:
    torch.manual_seed(0)
    plain_model = Net()
    profiled_model = copy.deepcopy(plain_model)
    plain = KFACPreconditioner(plain_model, compute_method=method, **KW)
    profiled = KFACPreconditioner(profiled_model, compute_method=method, **KW)
    profiled.profile = profile = StepProfile(record_shapes=True)
    for step in range(9):
        got = train_step(profiled_model, profiled, step)
        want = train_step(plain_model, plain, step)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), f"step {step}: the profiled gradient differs"
    shapes = {len(o.shape) for o in profile.operations if o.phase == PRODUCTS}
    assert shapes == {2, 3}  # layers on their own and a stacked group both ran
    kinds = {o.kind for o in profile.operations if o.phase == DECOMPOSE}
    assert kinds == {"eigh" if method == "eigen" else "inverse"}
    for layer_type in ("Embedding", "Conv1d", "Linear"):
        assert profile.seconds[term_phase("A", layer_type)] > 0
        assert profile.seconds[term_phase("G", layer_type)] > 0


def test_the_stages_add_up_to_the_step_and_the_hooks() -> None:
    torch.manual_seed(0)
    model = Net()
    precond = KFACPreconditioner(model, **KW)
    train_step(model, precond, 0)  # lazy set-up outside the profile
    precond.profile = profile = StepProfile()
    outside = 0.0
    fwd_bwd = 0.0
    for step in range(1, 9):
        x, y = batch(step)
        model.zero_grad()
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        middle = time.perf_counter()
        precond.step()
        end = time.perf_counter()
        fwd_bwd += middle - start
        outside += end - middle
    stages = profile.stages()
    s = profile.seconds
    assert sum(stages.values()) == pytest.approx(s[STEP] + s[CAPTURE], rel=1e-9, abs=1e-12)
    assert all(v >= 0 for v in stages.values()), stages
    # the step's own clock against the one outside it: the same interval
    # less the call into step() and its grad-mode switch
    assert s[STEP] <= outside
    assert s[STEP] == pytest.approx(outside, rel=0.1, abs=2e-3)
    assert 0 < s[CAPTURE] <= fwd_bwd
    assert profile.calls[STEP] == 8 and profile.calls[REDUCE] == 4 and profile.calls[FOLD] == 4
    assert profile.calls[DECOMPOSE] == 8 and profile.calls[APPLY] == 8
    assert [path for path, _ in profile.steps] == [NON_FACTOR, FACTOR] * 4
    assert sum(seconds for _, seconds in profile.steps) == pytest.approx(s[STEP])


def test_nothing_is_recorded_when_detached() -> None:
    torch.manual_seed(0)
    model = Net()
    precond = KFACPreconditioner(model, **KW)
    assert precond.profile is None
    profile = StepProfile(record_shapes=True)
    precond.profile = profile
    precond.profile = None
    for step in range(5):
        train_step(model, precond, step)
    assert not profile.seconds and not profile.calls
    assert not profile.operations and not profile.steps
    with pytest.raises(TypeError, match="StepProfile"):
        precond.profile = object()  # type: ignore[assignment]


def test_a_skipped_step_is_kept_as_skipped() -> None:
    torch.manual_seed(0)
    first = nn.Linear(4, 6)
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(6, 3))
    precond = KFACPreconditioner(model, **KW)
    precond.profile = profile = StepProfile()
    x = torch.randn(8, 4)
    for poisoned in (False, True, False):
        model.zero_grad()
        model(x).square().sum().backward()
        if poisoned:
            assert first.weight.grad is not None
            first.weight.grad[0, 0] = float("nan")
            with pytest.warns(UserWarning, match="non-finite"):
                precond.step()
        else:
            precond.step()
    # the skipped step keeps its count: step 1 comes again, a non-factor step
    assert [path for path, _ in profile.steps] == [FACTOR, SKIPPED, NON_FACTOR]
    assert precond.nonfinite_steps == 1


class NoGraph:
    """A recorder whose replay does nothing: the host's part of a replay alone."""

    def record(self, work: Callable[[], None]) -> None:
        work()

    def replay(self) -> None:
        return None


def test_a_replayed_step_is_kept_as_replayed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    precond = KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
    precond.read_scalars = False  # the verdict stays on the device, as on a GPU
    precond.compile(recorder=NoGraph)
    precond.profile = profile = StepProfile()
    x = torch.randn(8, 4)
    for _ in range(4):
        model.zero_grad()
        model(x).square().sum().backward()
        precond.step()
    # the factor step, the recording, then replays (after the first, the settled path)
    assert [path for path, _ in profile.steps] == [FACTOR, REPLAYED, REPLAYED, REPLAYED]
    assert profile.calls[APPLY] == 4
    assert profile.seconds[PRODUCTS] > 0  # the factor step's (the recording is not timed)


def _hooked(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_off_takes_the_capture_hooks_off_and_puts_them_back() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    precond = KFACPreconditioner(model, **KW)
    on = _hooked(model)
    assert on == 3  # the pass counter on the root, a forward hook per layer
    x = torch.randn(8, 4)
    model.zero_grad()
    model(x).square().sum().backward()
    precond.step()
    with precond.hooks_off():
        assert _hooked(model) == 0
        with precond.hooks_off():  # nested: the outer one puts them back
            pass
        assert _hooked(model) == 0
        for _ in range(3):  # a factor step among them: nothing new to fold
            model.zero_grad()
            model(x).square().sum().backward()
            precond.step()
    assert _hooked(model) == on
    precond.profile = profile = StepProfile()
    model.zero_grad()
    model(x).square().sum().backward()
    precond.step()
    assert profile.seconds[CAPTURE] > 0  # step 4 is a factor step: captured again
    precond.remove_hooks()
    assert _hooked(model) == 0
    with pytest.raises(RuntimeError, match="remove_hooks"), precond.hooks_off():
        pass


def test_stacking_and_read_scalars_switches() -> None:
    torch.manual_seed(0)
    model = Net()
    precond = KFACPreconditioner(model, **KW)
    assert precond.stacking is True and precond.read_scalars is None
    precond.stacking = False
    precond.read_scalars = False
    assert precond.stacking is False and precond.read_scalars is False
    precond.profile = profile = StepProfile(record_shapes=True)
    for step in range(3):
        train_step(model, precond, step)
    assert {len(o.shape) for o in profile.operations if o.phase == PRODUCTS} == {2}
    with pytest.raises(TypeError, match="read_scalars"):
        precond.read_scalars = 1  # type: ignore[assignment]
    with pytest.raises(TypeError, match="stacking must be True or False"):
        precond.stacking = "False"  # type: ignore[assignment]  # a truthy string
    assert precond.stacking is False
