"""Tensor parallelism (parallelize_module, ColwiseParallel / RowwiseParallel) on gloo.

* ``tensor_parallel='exact'`` equals the dense single-process run with kaisa
  (float64, ≤ 1e-10): a 2-D mesh dp × tp = 2 × 2 with hand-averaged
  gradients at f = 1 and f = ½ over steps with factor/inverse intervals, and
  an attention block (q/k/v colwise, o rowwise) on 2 tp ranks.
* ``tensor_parallel='block'`` equals its own definition, a dense float64
  reference built here with ``torch.kron`` and an exact solve: each shard's
  block of A or G (the rowwise bias its own block with A = 1), running
  averages, stale decompositions between inverse steps and the KL clip over
  the whole model; the replicated bias stays bit-identical on every tp rank.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner, Topology
from kfac_defaults import kfac_pytorch

from harness import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-10
# kfac-pytorch's options: block_reference updates the factors every step (and
# decomposes every inv_every steps, 1 unless a test names it) and solves with
# the damping added to the Kronecker product, as the eigen method does
KW: dict[str, Any] = kfac_pytorch(damping=0.01, kl_clip=0.002, factor_decay=0.9, lr=0.1)
LR = 0.1


class MLP(nn.Module):
    """up: colwise, down: rowwise, head: replicated (torch cannot run a colwise layer into
    a rowwise one with uneven shards: the rowwise input DTensor assumes even ones)."""

    plan: ClassVar[dict[str, str]] = {"up": "colwise", "down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(5, 6), nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


class Attention(nn.Module):
    """A replicated input projection, q/k/v colwise, o rowwise, a replicated head;
    attention over the local heads (``width // head_dim`` of them per rank)."""

    plan: ClassVar[dict[str, str]] = {
        "q": "colwise",
        "k": "colwise",
        "v": "colwise",
        "o": "rowwise",
    }

    def __init__(self, d: int = 8, head_dim: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.head = nn.Linear(d, 5)
        self.head_dim = head_dim

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        h = self.inp(x)

        def heads(z: Tensor) -> Tensor:
            return z.reshape(n, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1) @ v
        return self.head(torch.tanh(self.o(a.transpose(1, 2).reshape(n, t, -1))))


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return (MLP() if kind == "mlp" else Attention()).double()


def data(kind: str, n: int, steps: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    if kind == "mlp":
        shape, classes = (n, 5), 3
        return [
            (
                torch.randn(*shape, generator=g, dtype=torch.float64),
                torch.randint(0, classes, (n,), generator=g),
            )
            for _ in range(steps)
        ]
    return [
        (
            torch.randn(n, 3, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 5, (n, 3), generator=g),
        )
        for _ in range(steps)
    ]


def loss_of(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def loss_average(kind: str) -> str:
    return "batch" if kind == "mlp" else "batch_and_sequence"


def local_of(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- the tensor-parallel run -------------------------------------------------------
def tp_run(rank: int, world: int, kind: str, dims: tuple[int, int], opts: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dp = dims[0]
    mesh = init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))
    net = make(kind)
    # local_output=False: colwise outputs and their gradients stay DTensors, as
    # hooks registered before parallelize_module see them
    local_output = opts.pop("local_output", True)
    styles = {
        "colwise": lambda: ColwiseParallel(use_local_output=local_output),
        "rowwise": RowwiseParallel,
    }
    parallelize_module(net, mesh["tp"], {n: styles[s]() for n, s in net.plan.items()})
    opt = torch.optim.SGD(net.parameters(), lr=LR, foreach=False)
    # kaisa's worker/receiver groups are unflattened from the mesh's dp dimension
    topology = Topology.from_mesh(mesh, dp="dp", tp="tp") if dp > 1 else None
    resume_at = opts.pop("resume_at", None)

    def build() -> KFACPreconditioner:
        return KFACPreconditioner(
            net, optimizer=opt, topology=topology, loss_average=loss_average(kind), **opts
        )

    precond = build()
    me = mesh.get_coordinate()[0]
    batches, grads, stats = data(kind, 4 * dp, STEPS), [], []
    for step, (x, y) in enumerate(batches):
        if step == resume_at:  # a new preconditioner, restored from a checkpoint
            state = precond.state_dict(include_second_order=True)
            precond.remove_hooks()
            precond = build()
            precond.load_state_dict(state)
        opt.zero_grad()
        micro(net, x[me * 4 : (me + 1) * 4], y[me * 4 : (me + 1) * 4], opts)
        for p in net.parameters():  # average over the data-parallel group by hand
            local = local_of(p.grad)
            dist.all_reduce(local, group=mesh["dp"].get_group())
            local /= dp
        precond.step()
        grads.append({n: full(p.grad).clone() for n, p in net.named_parameters()})
        stats.append(precond.comm_stats()["step"])
        opt.step()
    bias = {n: local_of(p.grad).clone() for n, p in net.named_parameters() if "bias" in n}
    layers, text = list(precond.layers), precond.describe()
    return {"grads": grads, "layers": layers, "stats": stats, "bias": bias, "describe": text}


def micro(net: nn.Module, x: Tensor, y: Tensor, opts: dict) -> None:
    """Backward passes over ``accumulation_steps`` micro-batches of (x, y)."""
    k = opts.get("accumulation_steps", 1)
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        (loss_of(net(xs), ys) / k).backward()


STEPS = 4


def dense_run(kind: str, n: int, opts: dict) -> list[dict[str, Tensor]]:
    net = make(kind)
    opt = torch.optim.SGD(net.parameters(), lr=LR, foreach=False)
    precond = KFACPreconditioner(net, optimizer=opt, loss_average=loss_average(kind), **opts)
    grads = []
    for x, y in data(kind, n, STEPS):
        opt.zero_grad()
        micro(net, x, y, opts)
        precond.step()
        grads.append({k: p.grad.clone() for k, p in net.named_parameters()})
        opt.step()
    return grads


# -- the dense definition of block mode -------------------------------------------------
def chunks(n: int, size: int) -> list[list[int]]:
    c = -(-n // size)
    return [list(range(min(t * c, n), min((t + 1) * c, n))) for t in range(size)]


def blocks_of(name: str, style: str | None, d_out: int, d_in: int, tp: int) -> list:
    """(rows, cols) index sets of the gradient matrix ``[d_out, d_in + 1]``
    preconditioned together: the whole layer, or block mode's shard blocks."""
    rows, cols = list(range(d_out)), list(range(d_in + 1))
    if style == "colwise":
        return [(r, cols) for r in chunks(d_out, tp)]
    if style == "rowwise":
        return [(rows, c) for c in chunks(d_in, tp)] + [(rows, [d_in])]
    return [(rows, cols)]


def reference_block(kind: str, n: int, tp: int, inv_every: int) -> list[dict[str, Tensor]]:
    """Block-mode K-FAC by its definition, in one process, float64."""
    return block_reference(make(kind), data(kind, n, STEPS), tp, inv_every)


def block_reference(
    net: nn.Module, batches: list[tuple[Tensor, Tensor]], tp: int, inv_every: int
) -> list[dict[str, Tensor]]:
    """Block-mode K-FAC of ``net`` (``nn.Linear`` layers, sharded as ``net.plan``
    says) on ``batches`` of batch-first inputs, by its definition, float64."""
    linears = {name: m for name, m in net.named_modules() if isinstance(m, nn.Linear)}
    seen: dict[str, Any] = {}
    for name, m in linears.items():
        m.register_forward_hook(lambda mod, i, o, name=name: seen.__setitem__(name, (i[0], o)))
    running: dict[str, tuple[Tensor, Tensor]] = {}
    used: dict[str, tuple[Tensor, Tensor]] = {}
    out = []
    for step, (x, y) in enumerate(batches):
        n = x.shape[0]
        net.zero_grad()
        loss = loss_of(net(x), y)
        outs = torch.autograd.grad(loss, [seen[k][1] for k in linears], retain_graph=True)
        loss.backward()
        positions = x.shape[1] if x.dim() == 3 else 1
        for (name, m), g in zip(linears.items(), outs):
            a = seen[name][0].detach().reshape(-1, m.in_features)
            a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
            gh = g.reshape(-1, m.out_features) * (n * positions)  # ĝ of the mean loss
            batch = (a.t() @ a / a.shape[0], gh.t() @ gh / n)
            old = running.get(name)
            running[name] = (
                batch if old is None else tuple(0.9 * o + 0.1 * b for o, b in zip(old, batch))
            )
            if step % inv_every == 0:
                used[name] = running[name]
        vs, dot = {}, torch.zeros((), dtype=torch.float64)
        for name, m in linears.items():
            A, G = used[name]
            grad = torch.cat([m.weight.grad, m.bias.grad[:, None]], dim=1)
            v = torch.zeros_like(grad)
            for r, c in blocks_of(name, net.plan.get(name), m.out_features, m.in_features, tp):
                k = torch.kron(A[c][:, c], G[r][:, r])
                rhs = grad[r][:, c].t().reshape(-1)
                sol = torch.linalg.solve(
                    k + KW["damping"] * torch.eye(k.shape[0], dtype=k.dtype), rhs
                )
                v[torch.tensor(r)[:, None], torch.tensor(c)[None, :]] = sol.reshape(
                    len(c), len(r)
                ).t()
            vs[name] = v
            dot += (v * grad).sum()
        nu = min(1.0, math.sqrt(KW["kl_clip"] / abs(LR * LR * float(dot))))
        grads = {}
        for name, m in linears.items():
            v = vs[name] * nu
            grads[f"{name}.weight"], grads[f"{name}.bias"] = v[:, :-1].clone(), v[:, -1].clone()
            with torch.no_grad():
                m.weight -= LR * grads[f"{name}.weight"]
                m.bias -= LR * grads[f"{name}.bias"]
        out.append(grads)
    return out


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_equal(results: list[dict], ref: list[dict[str, Tensor]]) -> None:
    """Every parameter's gradient within TOL of the reference, relative to its
    own norm or, for a gradient that is rounding noise (the key projection's
    bias: softmax ignores a shift shared by all keys), to the step's."""
    for rank, got in enumerate(results):
        for step, (g, r) in enumerate(zip(got["grads"], ref)):
            scale = torch.cat([t.reshape(-1) for t in r.values()]).norm()
            for name in r:
                err = float((g[name] - r[name]).norm() / max(r[name].norm(), 1e-6 * scale))
                assert err <= TOL, f"rank {rank} step {step} {name}: {err}"


# -- tests --------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("intervals", [(1, 2), (2, 2)])
def test_exact_on_a_dp_tp_mesh_equals_the_dense_run(
    fraction: float, intervals: tuple[int, int]
) -> None:
    factor_every, inv_every = intervals
    opts = dict(
        KW,
        grad_worker_fraction=fraction,
        factor_update_steps=factor_every,
        inv_update_steps=inv_every,
    )
    results = run_distributed(4, tp_run, "mlp", (2, 2), opts, timeout_s=90, pg_timeout_s=30)
    assert_equal(results, dense_run("mlp", 8, opts))
    # the colwise and rowwise layers have different primaries; the head is on every tp rank
    assert results[0]["layers"] != results[1]["layers"]
    assert all("head" in r["layers"] for r in results)
    assert "exact on tp rank" in results[0]["describe"] + results[1]["describe"]
    kinds = set(results[0]["stats"][0]) | set(results[1]["stats"][0])
    assert {"tp_factor_gather", "tp_grad_gather", "tp_grad_scatter"} <= kinds


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_block_on_a_dp_tp_mesh_equals_its_definition(fraction: float) -> None:
    opts = dict(KW, grad_worker_fraction=fraction, tensor_parallel="block", inv_update_steps=2)
    results = run_distributed(4, tp_run, "mlp", (2, 2), opts, timeout_s=90, pg_timeout_s=30)
    ref = reference_block("mlp", 8, 2, inv_every=2)
    assert_equal(results, ref)
    # block mode is not exact mode: the shard blocks drop the cross terms
    assert rel(dense_run("mlp", 8, opts)[0]["up.weight"], ref[0]["up.weight"]) > 1e-3
    # the rowwise bias is replicated, bit for bit, on both tp ranks
    assert torch.equal(results[0]["bias"]["down.bias"], results[1]["bias"]["down.bias"])
    assert not any(k.startswith("tp_") and k != "tp_agree" for k in results[0]["stats"][0])


@pytest.mark.parametrize("mode", ["exact", "block"])
def test_attention_block_on_two_tp_ranks(mode: str) -> None:
    opts = dict(KW, tensor_parallel=mode, inv_update_steps=1)
    results = run_distributed(2, tp_run, "attention", (1, 2), opts, timeout_s=90, pg_timeout_s=30)
    if mode == "exact":
        assert_equal(results, dense_run("attention", 4, opts))
        assert sorted(results[0]["layers"] + results[1]["layers"]) == sorted(
            ["head", "head", "inp", "inp", "q", "k", "v", "o"]
        )
    else:
        assert_equal(results, reference_block("attention", 4, 2, inv_every=1))


def test_factors_from_a_fraction_of_the_positions_on_a_dp_tp_mesh() -> None:
    """Every rank (dp and tp alike) reads the positions one process reads
    (kaisa.core.positions): 2 of each call's 3 positions here."""
    opts = dict(KW, grad_worker_fraction=0.5, inv_update_steps=1, factor_position_fraction=0.5)
    results = run_distributed(4, tp_run, "attention", (2, 2), opts, timeout_s=90, pg_timeout_s=30)
    want = dense_run("attention", 8, opts)
    assert_equal(results, want)
    every = dense_run("attention", 8, dict(opts, factor_position_fraction=1.0))
    assert rel(every[-1]["inp.weight"], want[-1]["inp.weight"]) > 1e-6  # the cut changed it


@pytest.mark.parametrize("mode", ["exact", "block"])
def test_dtensor_outputs_and_gradients_are_captured(mode: str) -> None:
    opts = dict(KW, tensor_parallel=mode, local_output=False)
    results = run_distributed(2, tp_run, "mlp", (1, 2), opts, timeout_s=90, pg_timeout_s=30)
    del opts["local_output"]
    ref = dense_run("mlp", 4, opts) if mode == "exact" else reference_block("mlp", 4, 2, 1)
    assert_equal(results, ref)


def built_before_parallelising(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    net = make("mlp")
    precond = KFACPreconditioner(net)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x, y = data("mlp", 4, 1)[0]
    try:
        loss_of(net(x), y).backward()
        precond.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_preconditioner_built_before_parallelize_module_says_so() -> None:
    for message in run_distributed(2, built_before_parallelising, timeout_s=60, pg_timeout_s=20):
        assert "after parallelize_module" in message


def test_exact_with_deferred_capture_and_accumulation() -> None:
    opts = dict(KW, update_factors_in_hook=False, accumulation_steps=2, kfac_approx="reduce")
    results = run_distributed(2, tp_run, "attention", (1, 2), opts, timeout_s=90, pg_timeout_s=30)
    assert_equal(results, dense_run("attention", 4, opts))


@pytest.mark.parametrize("mode", ["exact", "block"])
def test_a_checkpoint_resumes_the_same_run(mode: str) -> None:
    opts = dict(KW, tensor_parallel=mode, inv_update_steps=2, resume_at=1)
    results = run_distributed(2, tp_run, "mlp", (1, 2), opts, timeout_s=90, pg_timeout_s=30)
    del opts["resume_at"]
    ref = dense_run("mlp", 4, opts) if mode == "exact" else reference_block("mlp", 4, 2, 2)
    assert_equal(results, ref)


def too_few_layers(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    net = nn.Sequential(nn.Linear(4, 6))
    parallelize_module(net, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel()})
    try:
        KFACPreconditioner(net, tensor_parallel="exact")
    except ValueError as exc:
        KFACPreconditioner(net, tensor_parallel="block")  # one block per rank: fine
        return str(exc)
    return "no error"


def test_exact_mode_refuses_a_model_with_fewer_layers_than_tp_ranks() -> None:
    for message in run_distributed(2, too_few_layers, timeout_s=60, pg_timeout_s=20):
        assert "tensor_parallel='block'" in message


def test_tensor_parallel_argument_is_validated() -> None:
    with pytest.raises(ValueError, match="tensor_parallel must be one of 'exact', 'block'"):
        KFACPreconditioner(nn.Linear(2, 2), tensor_parallel="rows")
