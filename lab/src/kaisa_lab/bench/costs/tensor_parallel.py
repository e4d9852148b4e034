"""Bytes moved by tensor-parallel K-FAC: kaisa's two modes against kfac-pytorch's
GPT-NeoX approach.

Each model runs on a dp × tp mesh of gloo ranks on this machine
(:func:`kaisa_lab.bench.costs.ranks.run_ranks`; ``meshes``, by default the
2 × 2 mesh and tp = 4 alone), parallelised with ``parallelize_module`` (q, k,
v and an MLP's up projection ``ColwiseParallel``, o and down
``RowwiseParallel``, the input projection and the head replicated), for two
steps with ``factor_update_steps=inv_update_steps=2``: step 0 updates
factors and decompositions, step 1 only preconditions.  ``attention-d8`` is
the attention block of tests/distributed/test_tensor_parallel.py (d = 8, 4
heads, 4 sequences of 3 tokens per replica), ``block-d256`` a transformer
block (d = 256, 8 heads, MLP 1024, 8 sequences of 32 tokens per replica),
float32.  kaisa runs in exact mode at f = 1 and f = 1/dp, and in block mode
at f = 1; its numbers are ``precond.comm_stats()["step"]`` summed over the
ranks:

* ``tp_*`` kinds are recorded as the bytes a rank *sends to another rank*,
  so their sum is the bytes on the network: ``tp_factor_gather`` (shards of
  a call's inputs or output gradients gathered onto a layer's primary),
  ``tp_grad_gather``, ``tp_grad_scatter``, ``tp_agree`` (4 bytes per sharded
  layer per step);
* the data-parallel kinds (``factor_reduce``, ``eigen_broadcast``,
  ``grad_broadcast``, ...) and ``model_parallel`` (the KL clip's sum) are
  kaisa's usual per-rank buffer bytes (the ``dp`` columns).

The GPT-NeoX row is a formula (kfac-pytorch ``kfac/gpt_neox``, MEM-OPT
only): for a sharded layer it gathers a call's shards onto the primary with
an ``all_gather`` in which every rank receives every shard and only the
primary keeps them, all-gathers the weight (and a colwise bias) gradient the
same way, and sends the preconditioned shards back with a ``reduce_scatter``
of zero-filled full-size buffers (a rowwise bias by ``broadcast``).  With T
tp ranks and a full tensor of F bytes, ring all-gather and reduce-scatter
each put (T−1)·F bytes on the network; kaisa's ``gather``/``scatter`` put
(T−1)·F/T.  Its data-parallel side (factors all-reduced, the replicated
factor over dp × tp ranks) is not counted.

Every number is a byte count: a re-run reproduces it exactly (the tests
compare a quick run with the committed records).  Table ``bytes``: what
docs/reports/communication.md shows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kaisa import KFACPreconditioner, Topology
from kaisa_lab.bench.costs.ranks import run_ranks
from kaisa_lab.bench.timing import Records, Row, TimingCase, register

__all__ = ["CASE", "MODELS", "Block", "gpt_neox"]


class Block(nn.Module):
    """Attention (q/k/v colwise, o rowwise) and optionally an MLP (up colwise,
    down rowwise) between replicated input and output projections."""

    def __init__(self, d_in: int, d: int, heads: int, ffn: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up: nn.Linear | None = nn.Linear(d, ffn) if ffn else None
        self.down: nn.Linear | None = nn.Linear(ffn, d) if ffn else None
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


MODELS: dict[str, dict[str, int]] = {
    # the attention block of tests/distributed/test_tensor_parallel.py
    "attention-d8": dict(d_in=6, d=8, heads=4, ffn=0, classes=5, batch=4, seq=3),
    # a transformer block: attention + MLP, d = 256
    "block-d256": dict(d_in=64, d=256, heads=8, ffn=1024, classes=64, batch=8, seq=32),
}
GPT_NEOX = "GPT-NeoX (formula)"


def build(name: str) -> tuple[Block, dict[str, int]]:
    spec = MODELS[name]
    torch.manual_seed(0)
    keys = ("d_in", "d", "heads", "ffn", "classes")
    return Block(**{k: spec[k] for k in keys}), spec


def _rank(
    rank: int, world: int, mesh_shape: tuple[int, int], name: str, mode: str, fraction: float
) -> list[dict[str, Any]]:
    """``comm_stats()['step']`` of this rank after step 0 and after step 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=("dp", "tp"))
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
    return steps


def kaisa_bytes(
    mesh_shape: tuple[int, int], name: str, mode: str, fraction: float
) -> list[dict[str, int]]:
    """Bytes per collective kind summed over the ranks, for step 0 and step 1."""
    per_rank = run_ranks(math.prod(mesh_shape), _rank, tuple(mesh_shape), name, mode, fraction)
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


def configurations(mesh_shape: tuple[int, int]) -> list[tuple[str, float]]:
    """kaisa's (mode, fraction) on a mesh: one dp rank makes f = 1/dp the same as f = 1."""
    return list(dict.fromkeys([("exact", 1.0), ("exact", 1 / mesh_shape[0]), ("block", 1.0)]))


def measure(options: Mapping[str, Any]) -> list[Row]:
    unknown = set(options["models"]) - set(MODELS)
    if unknown:
        raise ValueError(f"unknown models {sorted(unknown)}; choose from {sorted(MODELS)}")
    rows = []
    for dp, tp in options["meshes"]:
        mesh_shape = (int(dp), int(tp))
        for name in options["models"]:
            config = {"mesh": list(mesh_shape), "model": name, **MODELS[name]}
            neox = gpt_neox(mesh_shape, name)
            rows.append(
                Row(f"{dp}x{tp} {name} {GPT_NEOX}", {**config, "configuration": GPT_NEOX}, neox)
            )
            for mode, fraction in configurations(mesh_shape):
                steps = kaisa_bytes(mesh_shape, name, mode, fraction)
                tp_bytes = [sum(v for k, v in s.items() if k.startswith("tp_")) for s in steps]
                dp_bytes = [sum(v for k, v in s.items() if not k.startswith("tp_")) for s in steps]
                label = f"kaisa {mode}, f={fraction:g}"
                result = {
                    "factor_step_tp": tp_bytes[0],
                    "step_tp": tp_bytes[1],
                    "factor_step_dp": dp_bytes[0],
                    "step_dp": dp_bytes[1],
                    "kinds": steps,
                }
                rows.append(
                    Row(
                        f"{dp}x{tp} {name} {label}",
                        {**config, "configuration": label, "mode": mode, "fraction": fraction},
                        result,
                    )
                )
    return rows


def label(mesh_shape: list[int], config: str) -> str:
    """A row's configuration as the docs name it: the GPT-NeoX formula is
    MEM-OPT on a dp > 1 mesh, and one dp rank has no fraction (f = 1/dp is 1)."""
    dp_size = mesh_shape[0]
    if config.startswith("GPT-NeoX"):
        return "GPT-NeoX (formula, MEM-OPT)" if dp_size > 1 else "GPT-NeoX (formula)"
    if dp_size == 1:
        return config.split(",")[0]
    return config.replace("f=0.5", "f=½")


def _order(records: Records) -> list[Mapping[str, Any]]:
    """The records in the order of the options: mesh, model, then configuration."""
    options = records[0]["config"]["options"] if records else {}
    meshes = [list(m) for m in options.get("meshes", [])]
    models = list(options.get("models", []))

    def key(r: Mapping[str, Any]) -> tuple[int, int, int]:
        c = r["config"]
        mesh = tuple(c["mesh"])
        kinds = [GPT_NEOX, *(f"kaisa {m}, f={f:g}" for m, f in configurations(mesh))]
        return (
            meshes.index(c["mesh"]) if c["mesh"] in meshes else len(meshes),
            models.index(c["model"]) if c["model"] in models else len(models),
            kinds.index(c["configuration"]) if c["configuration"] in kinds else len(kinds),
        )

    return sorted(records, key=key)


def table(records: Records) -> str:
    """The bytes table of docs/reports/communication.md (bytes only: exactly reproducible)."""
    lines = [
        "| dp × tp | model | configuration | tp bytes, factor step | tp bytes, other step "
        "| kaisa dp-side bytes, factor step | kaisa dp-side bytes, other step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in _order(records):
        c, s = r["config"], r["result"]
        dp = ["—", "—"] if "step_dp" not in s else [f"{s['factor_step_dp']:,}", f"{s['step_dp']:,}"]
        mesh = " × ".join(map(str, c["mesh"]))
        lines.append(
            f"| {mesh} | {c['model']} | {label(c['mesh'], c['configuration'])} "
            f"| {s['factor_step_tp']:,} | {s['step_tp']:,} | {dp[0]} | {dp[1]} |"
        )
    return "\n".join(lines) + "\n"


CASE = register(
    TimingCase(
        name="tensor-parallel-comm",
        description="bytes moved by tensor-parallel K-FAC (kaisa exact and block modes) against "
        "kfac-pytorch's GPT-NeoX approach, on dp × tp meshes of gloo ranks",
        measure=measure,
        options={"meshes": [[2, 2], [1, 4]], "models": list(MODELS)},
        quick={"meshes": [[2, 2]], "models": ["attention-d8"]},
        tables={"bytes": table},
        deterministic=("factor_step_tp", "step_tp", "factor_step_dp", "step_dp", "kinds"),
    )
)
