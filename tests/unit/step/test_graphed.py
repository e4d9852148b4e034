"""A non-factor step recorded once and replayed (kaisa.step.graphed), on CPU.

CPU has no CUDA graphs, so :class:`Emulated` stands in for one and keeps
the graph's contract: a replay reads and writes the gradient tensors the
recording saw (not the current ``.grad``), reads the operands recorded
(it fails the test if they were replaced without a new recording), and
sees no Python value given after the recording except through the scalar
tensors.  With it the replayed training equals the eager step in float64
under damping and lr schedules, with gradients new each step or reused,
when a layer's gradient comes and goes, after a checkpoint load; and it
falls back to the eager step where it must.  tests/cuda runs real graphs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.layers.state import KFACLayer
from kaisa.step.diagnostics import StepDiagnostics
from kaisa.step.graphed import GraphedApplication, RecordingError
from kaisa.torch_support import COMPILE_FLOOR


class Emulated:
    """A stand-in for a CUDA graph: the work is run again at each replay on
    the gradient tensors present when it was recorded, and the operands it
    reads must be those it was recorded with."""

    def __init__(self, model: nn.Module, layers: list[KFACLayer], log: list[str]) -> None:
        self.params = [p for p in model.parameters()]
        self.layers = layers
        self.log = log

    def record(self, work: Callable[[], None]) -> None:
        self.grads = [p.grad for p in self.params]
        self.operands = self._operands()
        self.work = work
        self.log.append("record")
        work()

    def _operands(self) -> list[tuple[Tensor, int]]:
        return [(t, t._version) for la in self.layers for t in la.operands().values()]

    def replay(self) -> None:
        now = self._operands()
        assert len(now) == len(self.operands) and all(
            a is b and va == vb for (a, va), (b, vb) in zip(now, self.operands)
        ), "replayed with operands replaced since the recording"
        current = [p.grad for p in self.params]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.log.append("replay")
        try:
            self.work()
        finally:
            for p, g in zip(self.params, current):
                p.grad = g


def tower() -> nn.Module:
    """A group of stacked layers (3 × 16→16) and layers of their own shapes."""
    layers: list[nn.Module] = [nn.Linear(8, 16), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    layers += [nn.Linear(16, 4)]
    return nn.Sequential(*layers).double()


KW: dict[str, Any] = dict(
    factor_update_steps=3,
    inv_update_steps=6,
    damping=lambda s: 0.1 + 0.01 * s,
    lr=lambda s: 0.05 / (1 + 0.1 * s),
    kl_clip=1e-3,
)
#: the same as constants: after a replay the next non-factor steps take the
#: pipeline's settled path (kaisa.step.execute.ReplayedSteps.settled)
CONSTANT: dict[str, Any] = {**KW, "damping": 0.1, "lr": 0.05}
SCHEDULES = {"callable": KW, "constant": CONSTANT}


def accelerator_rule(
    model: nn.Module,
    precond: KFACPreconditioner,
    graphed: bool,
    recorder: type[Emulated] = Emulated,
) -> list[str]:
    """Scalars kept on the device (nothing read, as on an accelerator);
    where ``graphed``, non-factor steps replayed through ``recorder``.
    Returns the recordings' log."""
    pipeline = precond._parts.pipeline
    pipeline.application.read_scalars = False
    log: list[str] = []
    if graphed:
        layers = list(precond.layers.values())
        pipeline.graphed = GraphedApplication(
            pipeline.application, lambda: recorder(model, layers, log)
        )
    return log


def train(
    graphed: bool,
    steps: int = 20,
    set_to_none: bool = True,
    tamper: Callable[[nn.Module, int], None] | None = None,
    kwargs: dict[str, Any] | None = None,
    before: Callable[[KFACPreconditioner, int], None] | None = None,
    recorder: type[Emulated] | None = None,
) -> tuple[list[Tensor], list[str], KFACPreconditioner]:
    """``steps`` steps of SGD + kaisa under the accelerator's rule (nothing
    read to the host: the non-factor steps are deferred); ``tamper(model,
    s)`` changes step s's gradients."""
    torch.manual_seed(0)
    model = tower()
    precond = KFACPreconditioner(model, **(KW if kwargs is None else kwargs))
    log = accelerator_rule(model, precond, graphed, Emulated if recorder is None else recorder)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        if before is not None:
            before(precond, s)
        x = torch.randn(10, 8, generator=g, dtype=torch.float64)
        opt.zero_grad(set_to_none=set_to_none)
        model(x).logsumexp(-1).mean().backward()
        if tamper is not None:
            tamper(model, s)
        precond.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], log, precond


def assert_same(a: list[Tensor], b: list[Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert float((x - y).norm() / y.norm()) <= 1e-12


@pytest.mark.parametrize("schedule", ["callable", "constant"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_replays_equal_the_eager_step(method: str, set_to_none: bool, schedule: str) -> None:
    kwargs = {**SCHEDULES[schedule], "compute_method": method}
    want, _, _ = train(False, set_to_none=set_to_none, kwargs=kwargs)
    got, log, precond = train(True, set_to_none=set_to_none, kwargs=kwargs)
    assert_same(got, want)
    # constants: every non-factor step after the first (recorded the full
    # way) takes the settled path, replays and the later recordings alike
    shortcuts = precond._parts.pipeline.executor.shortcuts
    assert shortcuts == (13 - 1 if schedule == "constant" else 0)
    # steps 0..19 at intervals 3/6: the non-factor steps after each of the
    # four inverse updates (0, 6, 12, 18) record once and replay after
    assert log.count("record") == 4
    assert log.count("replay") == 13 - 4
    graphed = precond._parts.pipeline.graphed
    assert graphed is not None and graphed.recordings == 4
    # new gradient tensors are copied in (10 parameters a replay); reused ones
    # are the graph's own after its first replay, and nothing is copied
    assert graphed.copied == (10 * (13 - 4) if set_to_none else 0)


@pytest.mark.parametrize("schedule", ["callable", "constant"])
def test_a_layer_without_gradient_records_anew(schedule: str) -> None:
    """The set of layers taking part is the graph's key."""

    def drop(model: nn.Module, s: int) -> None:
        if s in (4, 5, 10):
            model[2].weight.grad = None
            model[2].bias.grad = None

    want, _, _ = train(False, tamper=drop, kwargs=SCHEDULES[schedule])
    got, log, _ = train(True, tamper=drop, kwargs=SCHEDULES[schedule])
    assert_same(got, want)
    # records at 1 (after 0), 4 (new set), 5 is the same set, 7 (after 6,
    # full set again), 10 (new set), 11 (full set), 13, 19
    assert log.count("record") == 7


def test_non_finite_gradients_are_counted_as_in_the_eager_step() -> None:
    """The deferred finiteness verdict is formed inside the replay (before
    the gradients are overwritten) and counted as the eager step counts it."""

    def poison(model: nn.Module, s: int) -> None:
        if s == 13:  # a replayed step: its NaN goes through (deferred), and after it
            model[4].weight.grad[0, 0] = float("nan")

    _, _, eager = train(False, steps=16, tamper=poison)
    _, log, precond = train(True, steps=16, tamper=poison)
    assert log[-1] == "replay"
    # counted when settled at step 15 (a factor step): 13, 14 (NaN weights), 15
    assert precond.nonfinite_steps == eager.nonfinite_steps == 3


def test_turning_the_kl_clip_off_and_on_records_anew() -> None:
    """Whether there is a KL clip is part of the key (no clip: no clip's
    terms in the graph); a changed bound is only a refilled scalar."""

    def before(precond: KFACPreconditioner, s: int) -> None:
        precond.kl_clip = {8: None, 10: 0.002}.get(s, precond.kl_clip)

    want, _, _ = train(False, before=before)
    got, log, _ = train(True, before=before)
    assert_same(got, want)
    # records at 1 and 7 (after the inverse updates at 0 and 6), at 8 (no
    # clip), at 10 (a clip again; the new bound alone would not), 13, 19
    assert log.count("record") == 6


def test_constants_changed_between_replays_take_effect_at_once() -> None:
    """Constant schedule values changed between replayed steps — damping and
    the KL clip's bound set as kfac-pytorch users set them (validated, and
    raw as its LambdaParamScheduler writes), the learning rate, the factor
    interval — reach the very next step, as eagerly: the settled path
    replays only while the schedule is unchanged."""
    changes: dict[int, tuple[str, Any]] = {
        5: ("damping", 0.3),
        8: ("_kl_clip", 0.004),
        10: ("lr", 0.02),
        11: ("_damping", 0.05),
        13: ("factor_update_steps", 4),
    }

    def before(precond: KFACPreconditioner, s: int) -> None:
        if s in changes:
            setattr(precond, *changes[s])

    want, _, _ = train(False, before=before, kwargs=CONSTANT)
    got, log, precond = train(True, before=before, kwargs=CONSTANT)
    assert_same(got, want)
    assert log.count("replay") >= 6 and precond._parts.pipeline.executor.shortcuts >= 4


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_second_step_without_backward_is_refused_after_a_replay(set_to_none: bool) -> None:
    """After a replayed step the gradients are the graph's tensors, marked
    by the replay's stamp rather than a mark per layer: a second ``step()``
    with no backward is still refused and changes nothing, and the next
    backward (new tensors, or accumulated into the graph's) is taken."""
    _, log, precond = train(True, steps=6, set_to_none=set_to_none, kwargs=CONSTANT)
    assert log[-1] == "replay"  # step 5, a replayed non-factor step
    model = precond.model
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="called again"):
        precond.step()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert precond.steps == 6
    model.zero_grad(set_to_none=set_to_none)
    model(torch.randn(10, 8, dtype=torch.float64)).logsumexp(-1).mean().backward()
    precond.step()  # step 6, an inverse step
    assert precond.steps == 7


def _tower_reading_the_optimizer(
    graphed: bool, **sgd: Any
) -> tuple[nn.Module, torch.optim.SGD, KFACPreconditioner, list[str]]:
    """The tower, SGD(``sgd``) whose learning rate kaisa reads, under the
    accelerator's rule; the recordings' log."""
    torch.manual_seed(0)
    model = tower()
    opt = torch.optim.SGD(model.parameters(), **sgd)
    kwargs = {k: v for k, v in KW.items() if k != "lr"}
    precond = KFACPreconditioner(model, optimizer=opt, **kwargs)
    return model, opt, precond, accelerator_rule(model, precond, graphed)


def _train_with_optimizer_lr(lr: float | Tensor, graphed: bool) -> tuple[list[Tensor], list[str]]:
    """SGD whose learning rate kaisa reads from the optimizer (decayed by a
    scheduler), under the accelerator's rule."""
    model, opt, precond, log = _tower_reading_the_optimizer(graphed, lr=lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(14):
        opt.zero_grad()
        model(torch.randn(10, 8, generator=g, dtype=torch.float64)).logsumexp(-1).mean().backward()
        precond.step()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()], log


@pytest.mark.needs_torch((2, 6), "an optimizer that leaves a tensor lr on the device")
def test_an_optimizer_tensor_lr_is_used_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor learning rate (a compiled or capturable optimizer's) is used
    by the KL clip as a tensor, never read as a number (a host
    synchronisation on an accelerator), eagerly and replayed, and gives
    what the same rate as a float gives."""
    want, _ = _train_with_optimizer_lr(0.05, graphed=False)
    item = torch.Tensor.item
    lr_tensors: list[Tensor] = []

    def guarded(self: Tensor) -> Any:
        assert not any(self is t for t in lr_tensors), "the learning rate was read"
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", guarded)
    monkeypatch.setattr(torch.Tensor, "__float__", lambda self: guarded(self))
    for graphed in (False, True):
        lr = torch.tensor(0.05, dtype=torch.float64)
        lr_tensors[:] = [lr]
        got, log = _train_with_optimizer_lr(lr, graphed)
        assert_same(got, want)
        assert not graphed or log.count("replay") >= 4


def _reports_of_transient_nans(graphed: bool) -> tuple[int, list[str], list[str]]:
    """Train with NaN gradients at a few non-factor steps whose optimizer
    step is skipped (so the NaN does not reach the weights); the count, the
    warnings and the recordings log."""
    torch.manual_seed(0)
    model = tower()
    precond = KFACPreconditioner(model, **KW)
    log = accelerator_rule(model, precond, graphed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(18):
            opt.zero_grad()
            model(torch.randn(10, 8, generator=g, dtype=torch.float64)).logsumexp(
                -1
            ).mean().backward()
            poisoned = s in (4, 7, 8, 13)  # non-factor steps (factor_update_steps=3)
            if poisoned:
                model[2].weight.grad[1, 1] = float("inf")
            precond.step()
            if not poisoned:
                opt.step()
    return precond.nonfinite_steps, [str(w.message) for w in caught], log


def test_non_finite_replayed_steps_are_reported_as_in_the_eager_step() -> None:
    """Counted on the device inside the graph (no per-step copy), settled at
    the factor steps: the same count, and warnings naming the same steps."""
    count, said, _ = _reports_of_transient_nans(False)
    replayed_count, replayed_said, log = _reports_of_transient_nans(True)
    assert log.count("replay") >= 8
    assert replayed_count == count == 4
    assert replayed_said == said and len(said) == 3  # at the 1st, 2nd and 4th
    assert "latest at step 7" in said[1] and "latest at step 13" in said[2]


def test_a_checkpoint_load_records_anew() -> None:
    """Loading replaces the operands (the pipeline recomputes them): the
    emulated graph fails if it is replayed on the old ones."""
    saved: dict[str, Any] = {}

    def before(precond: KFACPreconditioner, s: int) -> None:
        if s == 8:
            saved["state"] = copy.deepcopy(precond.state_dict())
        if s == 10:
            precond.load_state_dict(saved["state"])

    want, _, _ = train(False, before=before)
    got, log, _ = train(True, before=before)
    assert_same(got, want)
    # the load at s=10 brings back step 8's counter: recordings after the
    # inverse updates at steps 0 and 6, at the load (step 8 again), after 12
    # (a replay on the operands from before the load fails in Emulated)
    assert log.count("record") == 4


class Unrecordable(Emulated):
    """Runs the work, then cannot record it (an operation a CUDA graph refuses)."""

    def record(self, work: Callable[[], None]) -> None:
        self.log.append("record")
        work()
        raise RecordingError()


def test_a_step_that_cannot_be_recorded_runs_eagerly_from_then_on() -> None:
    """The step whose recording failed is complete (its work ran first);
    every later step runs eagerly, said once."""
    want, _, _ = train(False)
    with pytest.warns(UserWarning, match="could not be recorded as a CUDA graph"):
        got, log, precond = train(True, recorder=Unrecordable)
    assert_same(got, want)
    assert log == ["record"]
    graphed = precond._parts.pipeline.graphed
    assert graphed is not None and graphed.failed and graphed.recordings == 0


def test_diagnostics_run_the_eager_step() -> None:
    """Diagnostics record each step's ν in Python: nothing is replayed."""

    def before(precond: KFACPreconditioner, s: int) -> None:
        if s == 0:
            precond.diagnostics = StepDiagnostics()

    want, _, _ = train(False, before=before)
    got, log, precond = train(True, before=before)
    assert_same(got, want)
    assert log == []
    assert precond.diagnostics is not None and len(precond.diagnostics.kl_scales) == 20


@pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")
def test_compile_asks_for_graphs_only_on_cuda() -> None:
    """``precond.compile(mode='reduce-overhead')`` on a CPU model compiles the
    groups as before and records no graph."""
    model = tower()
    precond = KFACPreconditioner(model, **KW)
    precond.compile(mode="reduce-overhead")
    assert precond._parts.pipeline.graphed is None


@pytest.mark.needs_torch(COMPILE_FLOOR, "torch.compile")
def test_compiling_again_without_graphs_stops_the_replays() -> None:
    """A second ``compile()`` without a graph mode drops the replayed path."""
    torch.manual_seed(0)
    precond = KFACPreconditioner(tower(), **KW)
    pipeline = precond._parts.pipeline
    pipeline.graphed = GraphedApplication(pipeline.application)
    precond.compile()
    assert pipeline.graphed is None


def test_switching_stacking_records_anew() -> None:
    """The graph holds one write path: switching ``precond.stacking`` between
    two replays moves the groups' revision, and the next step records anew
    (nothing has to tell the graph)."""

    def before(precond: KFACPreconditioner, s: int) -> None:
        if s == 8:  # a non-factor step between replays (intervals 3/6)
            precond.stacking = False

    _, plain, _ = train(True)
    got, log, precond = train(True, before=before)
    want, _, _ = train(False, before=before)
    assert_same(got, want)
    assert log.count("record") == plain.count("record") + 1
    assert precond._parts.pipeline.application.groups.revision == 1


def test_second_order_state_counts_each_new_tensor() -> None:
    from kaisa.layers.state import SecondOrderState

    state = SecondOrderState()
    t = torch.zeros(2)
    state["qa"] = t
    state["qg"] = t
    assert state.generation == 2
    state["qa"].add_(1.0)  # in place: the address holds the current values
    assert state.generation == 2
    state.update(qa=torch.ones(2))
    state.pop("qg")
    state.clear()
    assert state.generation == 5 and not state


def _fused_with_a_bad_step(graphed: bool, left_out: bool) -> tuple[list[Tensor], list[str]]:
    """Fused SGD, whose update reads kaisa's device verdict as found_inf; a
    NaN at non-factor step 10 (replayed where ``graphed``), or finite
    gradients and that update left out."""
    model, opt, precond, log = _tower_reading_the_optimizer(
        graphed, lr=0.05, momentum=0.9, fused=True
    )
    g = torch.Generator().manual_seed(1)
    for s in range(14):
        opt.zero_grad()
        x = torch.randn(10, 8, generator=g, dtype=torch.float64)
        loss = model(x).logsumexp(-1).mean()
        (loss * (float("nan") if s == 10 and not left_out else 1.0)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            precond.step()
        if not (s == 10 and left_out):
            opt.step()
    return [p.detach().clone() for p in model.parameters()] + [
        st["momentum_buffer"].clone() for st in opt.state.values()
    ], log


def test_a_replayed_step_hands_its_verdict_to_a_fused_optimizer() -> None:
    """The verdict formed inside the recorded step reaches the optimizer's
    found_inf at each replay: the NaN step's update is left out, as eagerly."""
    for graphed in (False, True):
        want, _ = _fused_with_a_bad_step(graphed, left_out=True)
        got, log = _fused_with_a_bad_step(graphed, left_out=False)
        assert all(torch.isfinite(t).all() for t in got)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        assert not graphed or log.count("replay") >= 4


class Pinned(Emulated):
    """A graph's reads, more literally: a replay reads the very operand
    tensors the recording saw (at their current values: one changed in place
    is read as it is now), not the ones the eager step would look up now."""

    def record(self, work: Callable[[], None]) -> None:
        self.held = {la.name: dict(la.operands()) for la in self.layers}
        super().record(work)

    def replay(self) -> None:
        looked_up = {la.name: la.operands for la in self.layers}
        for la in self.layers:
            la.operands = (lambda held: lambda: held)(self.held[la.name])  # type: ignore[method-assign]
        try:
            self.operands = self._operands()  # changed in place: the graph's to read
            super().replay()
        finally:
            for la in self.layers:
                la.operands = looked_up[la.name]  # type: ignore[method-assign]


@pytest.mark.parametrize("precondition_dtype", [None, torch.float32])
def test_ekfac_scales_changed_in_place_are_read_by_the_replay(
    precondition_dtype: torch.dtype | None,
) -> None:
    """EKFAC folds its scales S into the same tensor on every factor step, with
    no new recording; a replay must read the new S, also through the cast
    copy ``precondition_dtype`` makes (refreshed in place, not replaced)."""
    kwargs = {
        **CONSTANT,
        "compute_method": "ekfac",
        "inv_dtype": torch.float64,
        "precondition_dtype": precondition_dtype,
    }
    want, _, _ = train(False, kwargs=kwargs)
    got, log, _ = train(True, kwargs=kwargs, recorder=Pinned)
    assert "replay" in log
    assert_same(got, want)
