"""Bytes moved by tensor-parallel K-FAC: kaisa's two modes vs kfac-pytorch's GPT-NeoX approach.

    PYTHONPATH=src python benchmarks/tensor_parallel_comm.py --out runs/bench

(``--markdown``: the table alone, as docs/benchmarks.md holds it in a region
that ``tools/docs_check.py`` re-runs; every number is a byte count, exactly
reproducible.)

Runs each model on a 2 × 2 mesh (dp × tp, W = 4 forked gloo ranks on the
CPU) for two steps with ``factor_update_steps=inv_update_steps=2``: step 0
updates factors and decompositions, step 1 only preconditions.  kaisa's
numbers are read from ``precond.comm_stats()["step"]`` summed over the four
ranks:

* ``tp_*`` kinds are recorded as the bytes a rank *sends to another rank*,
  so their sum is the bytes on the network: ``tp_factor_gather`` (shards of
  a call's inputs or output gradients gathered onto a layer's primary),
  ``tp_grad_gather``, ``tp_grad_scatter``, ``tp_agree`` (4 bytes per sharded
  layer per step);
* the data-parallel kinds (``factor_reduce``, ``eigen_broadcast``,
  ``grad_broadcast``, ...) and ``model_parallel`` (the KL clip's sum) are
  kaisa's usual per-rank buffer bytes.

The GPT-NeoX column is a formula (kfac-pytorch ``kfac/gpt_neox``, MEM-OPT
only): for a sharded layer it gathers a call's shards onto the primary with
an ``all_gather`` in which every rank receives every shard and only the
primary keeps them, all-gathers the weight (and a colwise bias) gradient the
same way, and sends the preconditioned shards back with a ``reduce_scatter``
of zero-filled full-size buffers (a rowwise bias by ``broadcast``).  With T
tp ranks and a full tensor of F bytes, ring all-gather and reduce-scatter
each put (T−1)·F bytes on the network; kaisa's ``gather``/``scatter`` put
(T−1)·F/T.  Its data-parallel side (factors all-reduced, the replicated
factor over dp × tp ranks) is not counted here.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import tempfile
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner, Topology

MESHES = ((2, 2), (1, 4))  # (dp, tp): the tested 2 × 2 mesh, and tp = 4 alone


class Block(nn.Module):
    """Attention (q/k/v colwise, o rowwise) and optionally an MLP (up colwise,
    down rowwise) between replicated input and output projections."""

    def __init__(self, d_in: int, d: int, heads: int, ffn: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = (nn.Linear(d, ffn), nn.Linear(ffn, d)) if ffn else (None, None)
        self.head = nn.Linear(d, classes)
        self.head_dim = d // heads

    def plan(self) -> dict[str, str]:
        out = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
        return out | ({"up": "colwise", "down": "rowwise"} if self.up is not None else {})

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        h = self.inp(x)

        def heads(z: Tensor) -> Tensor:
            return z.reshape(n, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(h)), heads(self.k(h)), heads(self.v(h))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1) @ v
        h = h + self.o(a.transpose(1, 2).reshape(n, t, -1))
        if self.up is not None and self.down is not None:
            h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


MODELS: dict[str, dict[str, Any]] = {
    # the attention block of tests/distributed/test_tensor_parallel.py
    "attention-d8": dict(d_in=6, d=8, heads=4, ffn=0, classes=5, batch=4, seq=3),
    # a transformer block: attention + MLP, d = 256
    "block-d256": dict(d_in=64, d=256, heads=8, ffn=1024, classes=64, batch=8, seq=32),
}


def build(name: str) -> tuple[Block, dict[str, Any]]:
    spec = MODELS[name]
    torch.manual_seed(0)
    keys = ("d_in", "d", "heads", "ffn", "classes")
    return Block(**{k: spec[k] for k in keys}), spec


def run_rank(
    rank: int, init: str, mesh_shape: tuple[int, int], name: str, mode: str, fraction: float,
    out: str,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=math.prod(mesh_shape),
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    model, spec = build(name)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh["tp"], {n: styles[s]() for n, s in model.plan().items()})
    precond = KFACPreconditioner(
        model,
        topology=Topology(dp=mesh["dp"].get_group(), tp=mesh["tp"].get_group()),
        tensor_parallel=mode,
        grad_worker_fraction=fraction,
        factor_update_steps=2,
        inv_update_steps=2,
        damping=0.01,
        loss_average="batch_and_sequence",
    )
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):
        x = torch.randn(spec["batch"], spec["seq"], spec["d_in"], generator=g)
        y = torch.randint(0, spec["classes"], (spec["batch"], spec["seq"]), generator=g)
        model.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        precond.step()
        steps.append(precond.comm_stats()["step"])
    torch.save(steps, f"{out}.{rank}")
    dist.destroy_process_group()


def measure(
    mesh_shape: tuple[int, int], name: str, mode: str, fraction: float
) -> list[dict[str, int]]:
    """Bytes per collective kind summed over the ranks, for step 0 and step 1."""
    ctx = mp.get_context("fork")
    world = math.prod(mesh_shape)
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "pg"), os.path.join(tmp, "stats")
        procs = [
            ctx.Process(target=run_rank, args=(r, init, mesh_shape, name, mode, fraction, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.exitcode != 0:
                raise RuntimeError(f"rank failed in {name} {mode} f={fraction}")
        per_rank = [torch.load(f"{out}.{r}") for r in range(world)]
    totals: list[dict[str, int]] = []
    for step in range(2):
        summed: dict[str, int] = defaultdict(int)
        for stats in per_rank:
            for kind, v in stats[step].items():
                summed[kind] += v["bytes"]
        totals.append(dict(summed))
    return totals


def gpt_neox(mesh_shape: tuple[int, int], name: str, bytes_per: int = 4) -> dict[str, int]:
    """kfac-pytorch's GPT-NeoX tp traffic (network bytes, ring collectives)."""
    dp_size, tp_size = mesh_shape
    model, spec = build(name)
    rows = spec["batch"] * spec["seq"]  # one call per step per layer
    factor = grad = 0
    for layer, style in model.plan().items():
        lin: nn.Linear = getattr(model, layer)
        sharded = lin.out_features if style == "colwise" else lin.in_features
        # all_gather in every tp group
        factor += dp_size * (tp_size - 1) * rows * sharded * bytes_per
        weight = lin.weight.numel() * bytes_per
        bias = lin.out_features * bytes_per
        # MEM-OPT: only the inverse worker's tp group gathers and scatters
        grad += (tp_size - 1) * (weight + (bias if style == "colwise" else 0))  # all_gather
        grad += (tp_size - 1) * (weight + bias)  # reduce_scatter (+ colwise bias) or bias broadcast
    return {"factor_step_tp": factor + grad, "step_tp": grad}


def table(out: Path) -> list[dict[str, Any]]:
    rows = []
    for mesh_shape in MESHES:
        for name in MODELS:
            neox = gpt_neox(mesh_shape, name)
            rows.append(dict(mesh=mesh_shape, model=name, config="GPT-NeoX (formula)", **neox))
            configs = [("exact", 1.0), ("exact", 1 / mesh_shape[0]), ("block", 1.0)]
            for mode, fraction in dict.fromkeys(configs):  # one dp rank: f = 1/dp is f = 1
                steps = measure(mesh_shape, name, mode, fraction)
                tp = [sum(v for k, v in s.items() if k.startswith("tp_")) for s in steps]
                dp = [sum(v for k, v in s.items() if not k.startswith("tp_")) for s in steps]
                rows.append(
                    dict(
                        mesh=mesh_shape,
                        model=name,
                        config=f"kaisa {mode}, f={fraction:g}",
                        factor_step_tp=tp[0],
                        step_tp=tp[1],
                        factor_step_dp=dp[0],
                        step_dp=dp[1],
                        kinds=steps,
                    )
                )
    out.mkdir(parents=True, exist_ok=True)
    (out / "tensor_parallel_comm.json").write_text(json.dumps(rows, indent=2))
    return rows


def label(mesh_shape: tuple[int, int], config: str) -> str:
    """A row's configuration as the docs name it: the GPT-NeoX formula is
    MEM-OPT on a dp > 1 mesh, and one dp rank has no fraction (f = 1/dp is 1)."""
    dp_size = mesh_shape[0]
    if config.startswith("GPT-NeoX"):
        return "GPT-NeoX (formula, MEM-OPT)" if dp_size > 1 else "GPT-NeoX (formula)"
    if dp_size == 1:
        return config.split(",")[0]
    return config.replace("f=0.5", "f=½")


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The bytes table of docs/benchmarks.md (bytes only: exactly reproducible)."""
    lines = [
        "| dp × tp | model | configuration | tp bytes, factor step | tp bytes, other step "
        "| kaisa dp-side bytes, factor step | kaisa dp-side bytes, other step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dp = ["—", "—"] if "step_dp" not in r else [f"{r['factor_step_dp']:,}", f"{r['step_dp']:,}"]
        mesh = " × ".join(map(str, r["mesh"]))
        lines.append(
            f"| {mesh} | {r['model']} | {label(r['mesh'], r['config'])} "
            f"| {r['factor_step_tp']:,} | {r['step_tp']:,} | {dp[0]} | {dp[1]} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table alone (docs/benchmarks.md holds it; tools/docs_check.py checks it)",
    )
    args = parser.parse_args()
    rows = table(args.out)
    if not args.markdown:
        print("float32; tp bytes on the network, kaisa's dp-side bytes as comm_stats() counts them")
    print("\n".join(markdown(rows)))


if __name__ == "__main__":
    main()
