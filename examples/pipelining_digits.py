"""K-FAC with torch.distributed.pipelining, on scikit-learn's digits.

    torchrun --nproc_per_node=2 examples/pipelining_digits.py --steps 100           # 2 stages
    torchrun --nproc_per_node=4 examples/pipelining_digits.py --dp 2 --steps 100    # × 2 replicas

A two-stage MLP on a ``dp × pp`` mesh.  Each rank runs one stage of a
``Schedule1F1B``; ``KFACPreconditioner(stage.submod, engine=PipeliningEngine(
schedule, dp=mesh["dp"]))`` preconditions that stage's layers with its
data-parallel peers, treats the micro-batches as accumulation steps and sums
the KL clip over the stages.  Gradients are averaged over ``dp`` by hand
before ``precond.step()``.  Runs on CPU with gloo; nothing is downloaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from kaisa import KFACPreconditioner
from kaisa.engines.pipelining import PipeliningEngine

BATCH = 64  # rows per replica and optimizer step


def stage_module(index: int) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every replica
    stages = [nn.Sequential(nn.Linear(64, 128), nn.ReLU()), nn.Linear(128, 10)]
    return stages[index]


def batches(
    x: torch.Tensor, y: torch.Tensor, mesh: DeviceMesh
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's batches, the same on both of its stages, epoch after epoch."""
    dp = mesh["dp"]
    sampler = torch.utils.data.DistributedSampler(
        torch.utils.data.TensorDataset(x, y),
        num_replicas=dp.size(),
        rank=dp.get_local_rank(),
        seed=0,
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        for start in range(0, len(order) - BATCH + 1, BATCH):
            rows = order[start : start + BATCH]
            yield x[rows], y[rows]
        epoch += 1


def average(module: nn.Module, mesh: DeviceMesh) -> None:
    """The replicas' mean gradient (what DDP would do)."""
    group, size = mesh["dp"].get_group(), mesh["dp"].size()
    for p in module.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--dp", type=int, default=1, help="replicas of the pipeline")
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.dp, 2), mesh_dim_names=("dp", "pp"))
    index = mesh["pp"].get_local_rank()
    module = stage_module(index)
    stage = PipelineStage(module, index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(
        stage.submod,
        optimizer=optimizer,
        engine=PipeliningEngine(schedule, dp=mesh["dp"]),
        damping=0.03,
        inv_update_steps=10,
    )

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    for xb, yb in batches(x, y, mesh):
        optimizer.zero_grad()
        schedule.step(*((xb,) if stage.is_first else ()), target=yb)
        average(module, mesh)
        precond.step()
        optimizer.step()
        if precond.steps >= args.steps:
            break

    rows = len(x) - len(x) % args.microbatches
    with torch.no_grad():
        out = schedule.eval(*((x[:rows],) if stage.is_first else ()), target=y[:rows])
    if stage.is_last and mesh["dp"].get_local_rank() == 0:
        accuracy = (out.argmax(1) == y[:rows]).float().mean().item()
        print(f"train accuracy after {args.steps} steps: {accuracy:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
