"""CUDA: the same numbers as the CPU float64 run, torch.amp on the GPU, NCCL.

These run only where a CUDA device exists (the lent GPU machine; CI has
none, and says so in the skip reason).  TF32 is switched off so float32 on
the GPU is compared with float64 on the CPU at float32 accuracy.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kaisa import KFACPreconditioner

from kfac_reference import rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine"
)


@pytest.fixture(autouse=True)
def no_tf32() -> Any:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class Net(nn.Module):
    """Every layer type kaisa preconditions: conv, embedding, attention, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.emb = nn.Embedding(10, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(4 * 16 + 8, 5)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(img)).flatten(1)
        e = self.emb(tok)
        a, _ = self.attn(e, e, e, need_weights=False)
        return self.fc(torch.cat([h, a.mean(1)], 1))


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(12, 1, 4, 4, generator=g)
    tok = torch.randint(0, 10, (12, 5), generator=g)
    return img, tok, torch.randint(0, 5, (12,), generator=g)


def train(
    device: str, dtype: torch.dtype, steps: int = 4, **kw: Any
) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, optimizer=opt, damping=0.01, kl_clip=0.05, inv_update_steps=2, **kw
    )
    grads: list[torch.Tensor] = []
    for s in range(steps):
        img, tok, y = (t.to(device) for t in data(s))
        opt.zero_grad()
        F.cross_entropy(model(img.to(dtype), tok), y).backward()
        precond.step()
        grads += [p.grad.detach().double().cpu() for p in model.parameters()]
        opt.step()
    return grads, precond.state_dict()


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_float32_on_cuda_equals_float64_on_cpu(method: str) -> None:
    ref, _ = train("cpu", torch.float64, compute_method=method)
    got, state = train("cuda", torch.float32, compute_method=method)
    assert len(state["layers"]) == 7  # conv, emb, q, k, v, out_proj, fc
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-4


def test_factors_and_inverses_stay_on_the_device() -> None:
    torch.manual_seed(0)
    model = Net().cuda()
    precond = KFACPreconditioner(model, inv_update_steps=1)
    img, tok, y = (t.cuda() for t in data(0))
    F.cross_entropy(model(img, tok), y).backward()
    precond.step()
    state = precond.state_dict(include_second_order=True)
    tensors = [t for entry in state["layers"].values() for t in entry.values()]
    assert tensors and all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))


def test_bf16_autocast_on_cuda_is_close_to_float32() -> None:
    """bf16 moves the whole preconditioned gradient by ~1% (measured on CPU
    autocast), while K-FAC itself moves it by more than 100%: the check has
    room on both sides."""

    def run(autocast: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(0)
        model = Net().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFACPreconditioner(model, optimizer=opt, damping=0.01, inv_update_steps=2)
        out = []
        for s in range(3):
            img, tok, y = (t.cuda() for t in data(s))
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(model(img, tok), y)
            loss.backward()
            raw = torch.cat([p.grad.detach().double().flatten().cpu() for p in model.parameters()])
            precond.step()
            got = torch.cat([p.grad.detach().double().flatten().cpu() for p in model.parameters()])
            out.append((raw, got))
            opt.step()
        return out

    for (_, bf16), (raw, fp32) in zip(run(True), run(False)):
        assert rel_err(bf16, fp32) < 0.05
        assert rel_err(bf16, fp32) < 0.05 * rel_err(fp32, raw)


def test_fp16_grad_scaler_on_cuda_skips_the_overflow_step() -> None:
    def run(poison: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = Net().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
        precond = KFACPreconditioner(model, optimizer=opt, grad_scaler=scaler, damping=0.01)
        for s in [0, 1, 99, 2] if poison else [0, 1, 2]:
            img, tok, y = (t.cuda() for t in data(s))
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(img, tok), y)
            if s == 99:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            precond.step()
            scaler.step(opt)
            scaler.update()
        return [p.detach().cpu() for p in model.parameters()], precond.state_dict()

    clean, clean_state = run(False)
    got, state = run(True)
    assert state["steps"] == clean_state["steps"]
    for a, b in zip(got, clean):
        assert torch.equal(a, b)


@contextlib.contextmanager
def one_rank_nccl() -> Iterator[None]:
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_nccl_ddp_one_rank_equals_the_plain_model() -> None:
    with one_rank_nccl():
        ref, _ = train("cuda", torch.float32)
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Net().cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        precond = KFACPreconditioner(
            model, optimizer=opt, damping=0.01, kl_clip=0.05, inv_update_steps=2
        )
        got = []
        for s in range(4):
            img, tok, y = (t.cuda() for t in data(s))
            opt.zero_grad()
            F.cross_entropy(model(img, tok), y).backward()
            precond.step()
            got += [p.grad.detach().double().cpu() for p in model.parameters()]
            opt.step()
        for a, b in zip(got, ref):
            assert rel_err(a, b) < 1e-5


class Tower(nn.Module):
    """An attention (kaisa's own under compile), four identical blocks
    (stacked by kaisa.step.batched) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 5)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        h = self.emb(tok)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h.mean(1))


def _tower_run(
    compiled: bool, steps: int = 6, **options: Any
) -> tuple[list[torch.Tensor], KFACPreconditioner]:
    torch.manual_seed(0)
    model = Tower().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(
        model, factor_update_steps=2, inv_update_steps=4, damping=0.05, **options
    )
    forward = torch.compile(model) if compiled else model
    for s in range(steps):
        _, tok, y = (t.cuda() for t in data(s))
        opt.zero_grad()
        F.cross_entropy(forward(tok), y).backward()
        precond.step()
        opt.step()
    return [p.detach().double().cpu() for p in model.parameters()], precond


def test_compiled_training_on_cuda_equals_eager() -> None:
    """Inductor on the GPU: the graph forms the statistics (step/capture/graph.py)."""
    torch._dynamo.reset()
    want, _ = _tower_run(False)
    got, precond = _tower_run(True)
    assert all(la.captured for la in precond.layers.values())
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4


def test_compiled_training_from_a_fraction_of_the_positions_on_cuda_equals_eager() -> None:
    """The positions' draws on the GPU, in inductor's graph (their key a graph
    input), are eager's, which are the host's."""
    from kaisa.core.positions import PositionSampler

    sampler = PositionSampler(0.4, seed=2)
    for step in (0, 2, 4):
        sampler.step = step
        host = sampler.kept("A", 7)
        assert host is not None and torch.equal(sampler.kept("A", 7, "cuda").cpu(), host)
    torch._dynamo.reset()
    options: dict[str, Any] = dict(factor_position_fraction=0.4, factor_position_seed=2)
    want, _ = _tower_run(False, 8, **options)
    got, precond = _tower_run(True, 8, **options)
    assert all(la.captured for la in precond.layers.values())
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4


def _graphed_run(
    graphed: bool, steps: int = 14, ddp: bool = False
) -> tuple[list[torch.Tensor], Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model: nn.Module = Tower().cuda()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        model,
        factor_update_steps=3,
        inv_update_steps=6,
        damping=lambda s: 0.05 + 0.002 * s,
        lr=lambda s: 0.1 / (1 + 0.1 * s),
        kl_clip=0.01,
    )
    if graphed:
        precond.compile(mode="reduce-overhead")
    for s in range(steps):
        _, tok, y = (t.cuda() for t in data(s))
        opt.zero_grad(set_to_none=s % 2 == 0)  # new gradient tensors, then reused ones
        F.cross_entropy(model(tok), y).backward()
        precond.step()
        opt.step()
    return [p.detach().double().cpu() for p in model.parameters()], precond


def test_replayed_non_factor_steps_equal_eager() -> None:
    """precond.compile(mode='reduce-overhead'): each non-factor step's
    application replayed as one CUDA graph (kaisa.step.graphed), recorded
    after each inverse update, with damping and lr schedules, trains as the
    eager step."""
    want, _ = _graphed_run(False)
    got, precond = _graphed_run(True)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4
    graphed = precond._parts.pipeline.graphed
    # inverse updates at steps 0, 6, 12: recorded at 1, 7, 13, replayed at 2, 4, 5, 8, 10, 11
    assert graphed is not None and graphed.recordings == 3


def test_replayed_steps_under_nccl_ddp_equal_the_plain_model() -> None:
    """DDP on one NCCL rank (every rank every layer's worker, no collective
    in a non-factor step): replayed as the single process's eager step."""
    want, _ = _graphed_run(False)
    with one_rank_nccl():
        got, precond = _graphed_run(True, ddp=True)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4
    assert precond._parts.pipeline.graphed.recordings == 3


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def test_a_replayed_step_launches_little_and_does_not_synchronise() -> None:
    """A replayed non-factor step: a few launches (the gradients' copy, one
    graph; no copy of the finiteness verdict: it is counted inside the
    graph) where the eager step launches dozens, and no host synchronisation."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for graphed in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Tower().cuda()
        precond = KFACPreconditioner(
            model, factor_update_steps=3, inv_update_steps=6, damping=0.05, kl_clip=0.01
        )
        if graphed:
            precond.compile(mode="reduce-overhead")
        for s in range(3):  # a factor step, a recording, then a replay
            _, tok, y = (t.cuda() for t in data(s))
            model.zero_grad()
            F.cross_entropy(model(tok), y).backward()
            if s < 2:
                precond.step()
                continue
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    precond.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            names = [e.name for e in prof.events()]
            counts[graphed] = (
                sum(names.count(n) for n in LAUNCHES),
                names.count("cudaGraphLaunch"),
                names.count("cudaMemcpyAsync"),
            )
    print("launches, graphs, copies eager / replayed:", counts)
    (eager, _, _), (replayed, graphs, copies) = counts[False], counts[True]
    assert graphs == 1 and copies == 0
    assert replayed <= 8 < eager


@pytest.mark.parametrize("lr", ["given", "optimizer tensor"])
def test_a_non_factor_step_on_cuda_does_not_synchronise(lr: str) -> None:
    """No device-to-host read in a non-factor step() (stacked layers, KL clip
    on), with the learning rate given or an optimizer's tensor on the device."""
    torch.manual_seed(0)
    model = Tower().cuda()
    options: dict[str, Any] = {"lr": 0.1}
    if lr == "optimizer tensor":
        rate = torch.tensor(0.1, device="cuda")
        options = {"optimizer": torch.optim.SGD(model.parameters(), lr=rate)}
    precond = KFACPreconditioner(
        model, factor_update_steps=3, inv_update_steps=6, damping=0.05, kl_clip=0.01, **options
    )
    for s in range(3):
        _, tok, y = (t.cuda() for t in data(s))
        model.zero_grad()
        F.cross_entropy(model(tok), y).backward()
        if s == 0:
            precond.step()  # a factor step: reads its counts
            continue
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            precond.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _fused_run(graphed: bool, left_out: bool) -> list[torch.Tensor]:
    """Fused SGD on the GPU; a NaN loss at non-factor step 4 (replayed where
    ``graphed``), or a finite one whose update is left out."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tower().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    precond = KFACPreconditioner(
        model, optimizer=opt, factor_update_steps=3, inv_update_steps=6, damping=0.05
    )
    if graphed:
        precond.compile(mode="reduce-overhead")
    for s in range(7):
        _, tok, y = (t.cuda() for t in data(s))
        opt.zero_grad()
        loss = F.cross_entropy(model(tok), y)
        (loss * (float("nan") if s == 4 and not left_out else 1.0)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deferred report
            precond.step()
        if not (s == 4 and left_out):
            opt.step()
    return [p.detach().cpu() for p in model.parameters()] + [
        st["momentum_buffer"].cpu() for st in opt.state.values()
    ]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "replayed"])
def test_a_fused_optimizer_skips_a_nan_non_factor_step_on_the_device(graphed: bool) -> None:
    """The non-factor step's verdict stays on the GPU and reaches the fused
    optimizer's found_inf: its update is left out, bit for bit."""
    want = _fused_run(graphed, left_out=True)
    got = _fused_run(graphed, left_out=False)
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_the_large_batch_forecast_measures_the_step_on_the_gpu(tmp_path: Any) -> None:
    """`kaisa bench run large-batch-forecast --device cuda`: every arm held out
    on text-lm is timed on the GPU, which its record names."""
    from pathlib import Path

    from kaisa_lab.bench.records import RecordStore
    from kaisa_lab.bench.timing import latest
    from kaisa_lab.cli.main import main

    committed = Path(__file__).resolve().parents[2] / "benchmarks" / "records"
    argv = ["bench", "run", "large-batch-forecast", "--quick", "--device", "cuda"]
    assert main([*argv, "--records", str(tmp_path), f"--option=records={committed}"]) == 0
    records = latest(RecordStore(tmp_path), "large-batch-forecast")
    assert records and all(r["result"]["measured"] for r in records)
    assert {r["config"]["options"]["device"] for r in records} == {"cuda"}
    assert all(r["environment"]["machine"]["gpu"] for r in records)


def test_step_cost_times_the_read_verdict_and_the_fused_skip_on_the_gpu(tmp_path: Any) -> None:
    """The step-cost variants that price an exact NaN skip on an accelerator
    (the verdict read every step; a fused SGD taking it on the device, replayed)
    are measured, each beside plain SGD."""
    from kaisa_lab.bench.records import RecordStore
    from kaisa_lab.bench.timing import latest
    from kaisa_lab.cli.main import main

    variants = '["sgd", "kfac eigen f=10 inv=100 read", "sgd fused", ' + (
        '"kfac eigen f=10 inv=100 fused replayed"]'
    )
    argv = ["bench", "run", "step-cost", "--quick", "--device", "cuda", "--option=device=cuda"]
    options = [f"--option=variants={variants}", "--option=reference_src=null"]
    assert main([*argv, *options, "--records", str(tmp_path)]) == 0
    records = latest(RecordStore(tmp_path), "step-cost")
    assert {r["config"]["variant"] for r in records} == set(json.loads(variants))
    assert all(r["result"]["mean_ms"] > 0 for r in records)
