"""One contract suite over every engine, on 2 gloo ranks.

Each engine is wired the way a user gets it (``KFACPreconditioner`` around
the model: ``select_engine``, ``select_layers``, ``connect``) and must meet
the same checks (:func:`check_contract`):

* ``unwrap`` finds the user's module inside the wrapper, and the registered
  layers are named as in that module;
* a training pass moves the gradient marks (the first and a later one), and
  they stay put without one;
* after backward every layer's gradient is present, the step is valid and
  the local gradients are finite;
* the full gradient matrix read (``read_many`` onto every worker, where the
  engine partitions its gradients; ``read`` otherwise) equals the gradient of
  an unsharded float64 copy of the model on the whole batch; read onto rank 0
  alone, rank 0 gets it and the other rank gets it or None;
* a matrix written reads back exactly, and so does the original written back
  (``after_write`` run where the engine has it).

Engines: ``TorchEngine`` under DDP, ``FSDP2Engine`` (uneven row shards),
``DeepSpeedEngine`` at ZeRO 0 and ZeRO 3 (one job), ``PipeliningEngine`` (two
stages) and ``TensorParallelEngine`` (exact mode: a colwise, a rowwise and a
replicated layer).  One job per engine; the single-process ``TorchEngine`` is
``tests/unit/engines/test_contracts.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.engines import Engine, GradientMarks, ModelParallelLayers, ShardedReads
from kaisa.layers.base import LayerAdapter

from harness import cpu_mesh, run_distributed

pytestmark = pytest.mark.distributed

ROWS = 4  # rows per rank and pass


@dataclass
class Case:
    """One engine, wired, and how to drive its training loop."""

    precond: KFACPreconditioner
    wrapped: Any  # what the user handed kaisa
    model: nn.Module  # the module its layers are named in
    #: a forward and backward pass over batch ``i`` (gradients zeroed first)
    backward: Callable[[int], None]
    #: the plain float64 model on the whole of batch ``i``: {layer name: [d_out, d_in + 1]}
    reference: Callable[[int], dict[str, Tensor]]
    workers: tuple[int, ...]  # the global ranks that precondition every layer
    tol: float = 1e-12
    #: what ends a training iteration, where the engine's marks count iterations
    advance: Callable[[], None] = field(default=lambda: None)


def mlp(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(dtype)


def batch(i: int, rows: int, seed: int = 7) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed + i)
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (rows,), generator=g
    )


def local_rows(i: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
    x, y = batch(i, ROWS * world)
    return x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]


def matrices(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    out = {}
    for name in names:
        layer = model.get_submodule(name)
        w = layer.weight.grad
        out[name] = w if layer.bias is None else torch.cat([w, layer.bias.grad[:, None]], 1)
    return out


def mlp_reference(world: int) -> Callable[[int], dict[str, Tensor]]:
    """The plain float64 MLP's gradients on the whole batch (the average of
    every rank's mean loss: equal rows per rank)."""

    def reference(i: int) -> dict[str, Tensor]:
        net = mlp()
        x, y = batch(i, ROWS * world)
        F.cross_entropy(net(x), y).backward()
        return matrices(net, ["0", "2", "4"])

    return reference


def read_all(engine: Engine, adapters: list[LayerAdapter], workers: tuple[int, ...]) -> list:
    if isinstance(engine, ShardedReads):
        return engine.read_many(adapters, [workers] * len(adapters))
    return [engine.read(a) for a in adapters]


def write_all(engine: Engine, adapters: list[LayerAdapter], values: list[Tensor]) -> None:
    for adapter, value in zip(adapters, values):
        engine.write(adapter, value.clone())
    if isinstance(engine, ModelParallelLayers):
        engine.after_write()


def check_contract(case: Case, rank: int) -> dict[str, Any]:
    """Every check of the contract; returns what the parent asserts on."""
    engine = case.precond._parts.engine
    adapters = [la.adapter for la in case.precond._parts.layers.values()]
    names = {n for n, _ in case.model.named_modules()}
    out: dict[str, Any] = {"engine": engine.name, "layers": [a.name for a in adapters]}
    out["unwraps"] = engine.unwrap(case.wrapped) is case.model
    out["named_in_model"] = all(a.name in names for a in adapters)

    marks = GradientMarks()
    marks.record(engine.gradient_marks(adapters))
    case.backward(0)
    case.advance()
    out["marks_move"] = not marks.unchanged(engine.gradient_marks(adapters))
    marks.record(engine.gradient_marks(adapters))
    out["marks_stay"] = marks.unchanged(engine.gradient_marks(adapters))

    case.backward(1)
    out["present"] = [engine.present(a) for a in adapters]
    valid = engine.step_is_valid()
    out["valid"] = bool(valid)
    local = engine.local_gradients(adapters)
    out["local_finite"] = bool(local) and all(bool(torch.isfinite(t).all()) for t in local)

    expected = case.reference(1)
    got = [None if g is None else g.clone() for g in read_all(engine, adapters, case.workers)]
    out["read_errors"] = [_rel(g, expected[a.name]) for a, g in zip(adapters, got)]
    if isinstance(engine, ShardedReads) and len(case.workers) > 1:
        onto = engine.read_many(adapters, [case.workers[:1]] * len(adapters))
        out["targeted"] = [
            (g is None and rank != case.workers[0]) or _rel(g, expected[a.name]) <= case.tol
            for a, g in zip(adapters, onto)
        ]

    g = torch.Generator().manual_seed(11)
    written = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype) for t in got]
    write_all(engine, adapters, written)
    back = read_all(engine, adapters, case.workers)
    out["write_reads_back"] = [torch.equal(b, w) for b, w in zip(back, written)]
    write_all(engine, adapters, got)
    again = read_all(engine, adapters, case.workers)
    out["round_trip"] = [torch.equal(b, w) for b, w in zip(again, got)]

    marks.record(engine.gradient_marks(adapters))  # gradients that exist now
    case.backward(2)
    case.advance()
    out["marks_move_again"] = not marks.unchanged(engine.gradient_marks(adapters))
    out["tol"] = case.tol
    return out


def _rel(got: Tensor | None, expected: Tensor) -> float:
    if got is None:
        return float("inf")
    got = got.to(torch.float64)
    return float((got - expected).norm() / expected.norm())


# -- the engines ------------------------------------------------------------------------------
def torch_ddp(rank: int, world: int) -> Case:
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    precond = KFACPreconditioner(ddp, lr=0.1)

    def backward(i: int) -> None:
        model.zero_grad(set_to_none=True)
        x, y = local_rows(i, rank, world)
        F.cross_entropy(ddp(x), y).backward()

    return Case(precond, ddp, model, backward, mlp_reference(world), tuple(range(world)))


def fsdp2(rank: int, world: int) -> Case:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    mesh = cpu_mesh(world)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    precond = KFACPreconditioner(model, lr=0.1)

    def backward(i: int) -> None:
        model.zero_grad(set_to_none=True)
        x, y = local_rows(i, rank, world)
        F.cross_entropy(model(x), y).backward()

    return Case(precond, model, model, backward, mlp_reference(world), tuple(range(world)))


def deepspeed_case(rank: int, world: int, stage: int) -> Case:
    from deepspeed_case import join

    deepspeed = join(rank, world)
    net = mlp(torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    # lr 0: DeepSpeed's step (which moves its marks) leaves the weights as they were
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    ds, *_ = deepspeed.initialize(
        model=net, optimizer=optimizer, config=cfg, dist_init_required=False
    )
    precond = KFACPreconditioner(ds)

    def backward(i: int) -> None:
        x, y = local_rows(i, rank, world)
        ds.backward(F.cross_entropy(ds(x.float()), y))

    return Case(
        precond,
        ds,
        ds.module,
        backward,
        mlp_reference(world),
        tuple(range(world)),
        tol=1e-6,  # float32, averaged by DeepSpeed in another order
        advance=ds.step,
    )


def pipelining(rank: int, world: int) -> Case:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from kaisa.engines.pipelining import PipeliningEngine

    def stages() -> list[nn.Sequential]:
        full = mlp()
        return [full[:2], full[2:]]

    module = stages()[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.cross_entropy)
    precond = KFACPreconditioner(module, lr=0.1, engine=PipeliningEngine(schedule))

    def backward(i: int) -> None:
        module.zero_grad(set_to_none=True)
        x, y = batch(i, ROWS * 2)
        schedule.step(*((x,) if stage.is_first else ()), target=y)

    def reference(i: int) -> dict[str, Tensor]:
        first, second = stages()
        x, y = batch(i, ROWS * 2)
        F.cross_entropy(second(first(x)), y).backward()
        mine = (first, second)[rank]
        return matrices(mine, [n for n, m in mine.named_modules() if isinstance(m, nn.Linear)])

    return Case(precond, module, module, backward, reference, (rank,))


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.head = nn.Linear(6, 6), nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.down(torch.tanh(self.up(x)))))


def tensor_parallel(rank: int, world: int) -> Case:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = TPNet().double()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, cpu_mesh(world), plan)  # type: ignore[arg-type]
    precond = KFACPreconditioner(model, lr=0.1, tensor_parallel="exact")

    def backward(i: int) -> None:  # every tp rank sees the same rows
        model.zero_grad(set_to_none=True)
        x, y = batch(i, ROWS)
        F.cross_entropy(model(x), y).backward()

    def reference(i: int) -> dict[str, Tensor]:
        net = TPNet().double()
        x, y = batch(i, ROWS)
        F.cross_entropy(net(x), y).backward()
        return matrices(net, ["up", "down", "head"])

    return Case(precond, model, model, backward, reference, (rank,))


def contract_job(rank: int, world: int, which: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    if which == "deepspeed":  # ZeRO 0 and 3 in one job: DeepSpeed's start costs seconds
        return [check_contract(deepspeed_case(rank, world, s), rank) for s in (0, 3)]
    build = {
        "torch-ddp": torch_ddp,
        "fsdp2": fsdp2,
        "pipelining": pipelining,
        "tensor_parallel": tensor_parallel,
    }[which]
    return [check_contract(build(rank, world), rank)]


ENGINES = {
    "torch-ddp": ["torch"],
    "fsdp2": ["fsdp2"],
    "deepspeed": ["deepspeed", "deepspeed"],
    "pipelining": ["pipelining"],
    "tensor_parallel": ["tensor_parallel"],
}


@pytest.mark.parametrize("which", list(ENGINES))
def test_every_engine_meets_the_contract(which: str) -> None:
    timeout: dict[str, Any] = {}
    if which == "deepspeed":
        from deepspeed_case import deepspeed_or_skip

        deepspeed_or_skip()
        timeout = dict(timeout_s=400, pg_timeout_s=300)  # the first start may build a C++ op
    for rank, results in enumerate(run_distributed(2, contract_job, which, **timeout)):
        assert [r["engine"] for r in results] == ENGINES[which]
        for r in results:
            where = f"{which} rank {rank}: {r}"
            assert r["layers"], where
            assert r["unwraps"] and r["named_in_model"], where
            assert r["marks_move"] and r["marks_stay"] and r["marks_move_again"], where
            assert all(r["present"]) and r["valid"] and r["local_finite"], where
            assert max(r["read_errors"]) <= r["tol"], where
            assert all(r.get("targeted", [True])), where
            assert all(r["write_reads_back"]) and all(r["round_trip"]), where
