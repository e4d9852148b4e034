"""Megatron-core's ColumnParallelLinear → RowParallelLinear MLP (the usual
``gather_output=False`` / ``input_is_parallel=True`` pair) on gloo, float64.

* ``tensor_parallel='exact'`` equals the dense single-process run of the same
  MLP built from ``nn.Linear`` (≤ 1e-10 relative): 2 tp ranks, with and
  without ``skip_bias_add``, factor/inverse intervals over four steps; a
  2 × 2 dp × tp job (W = 4) with Megatron's ``parallel_state`` groups as the
  ``Topology`` at f = ½; and the layers alone (tensor-parallel size 1, one
  process), where they are ordinary linears with ``[s, b, h]`` inputs.
* ``tensor_parallel='block'`` equals its dense definition
  (``test_tensor_parallel.block_reference``).
* Settings kaisa cannot precondition are refused, naming the setting.

Skipped, with the reason, only where ``megatron.core`` cannot be imported.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner, Topology

from harness import run_distributed
from test_tensor_parallel import KW, LR, TOL, block_reference, loss_of

pytestmark = pytest.mark.distributed

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # silences a Megatron warning
with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:  # not installed, or broken against this torch
        pytest.skip(f"megatron.core cannot be imported: {exc}", allow_module_level=True)

IN, HID, OUT, CLASSES = 5, 8, 6, 3
BATCH, SEQ, STEPS = 4, 3, 4


class Dense(nn.Module):
    """The MLP in one process: ``fc1`` is the column layer, ``fc2`` the row layer."""

    plan: ClassVar[dict[str, str]] = {"fc1": "colwise", "fc2": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(IN, HID), nn.Linear(HID, OUT)
        self.head = nn.Linear(OUT, CLASSES)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Megatron(nn.Module):
    """The same MLP with Megatron's layers (``[s, b, h]`` in, ``(output, bias)``
    out), its shards copied from :class:`Dense`; ``head`` stays replicated.  It
    is a plain ``nn.Linear``, which takes the batch first: given ``[s, b, h]``
    it would count the sequence as the batch (G divided by s, not b)."""

    def __init__(self, config: Any, skip_bias_add: bool, **settings: Any) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        common = dict(config=config, init_method=nn.init.zeros_, bias=True)
        gather = settings.pop("gather_output", False)
        parallel_in = settings.pop("input_is_parallel", True)
        self.fc1 = ColumnParallelLinear(
            IN, HID, gather_output=gather, skip_bias_add=skip_bias_add, **common
        )
        self.fc2 = RowParallelLinear(
            HID, OUT, input_is_parallel=parallel_in, skip_bias_add=skip_bias_add, **common
        )
        self.head = nn.Linear(OUT, CLASSES).double()

    def load(self, dense: Dense, tp_rank: int, tp: int) -> None:
        rows = cols = slice(tp_rank * HID // tp, (tp_rank + 1) * HID // tp)
        with torch.no_grad():
            self.fc1.weight.copy_(dense.fc1.weight[rows])
            self.fc1.bias.copy_(dense.fc1.bias[rows])
            self.fc2.weight.copy_(dense.fc2.weight[:, cols])
            self.fc2.bias.copy_(dense.fc2.bias)
            self.head.load_state_dict(dense.head.state_dict())

    def forward(self, x: Tensor) -> Tensor:
        h, b = self.fc1(x)
        h = torch.tanh(h if b is None else h + b)
        y, b = self.fc2(h)
        return self.head(torch.tanh(y if b is None else y + b).transpose(0, 1))


def batches(n: int) -> list[tuple[Tensor, Tensor]]:
    """Batch-first ``(x [n, SEQ, IN], y [n, SEQ])`` per step."""
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(n, SEQ, IN, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (n, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def config(tp: int, **settings: Any) -> Any:
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,  # CPU: Megatron's GPU init calls torch.cuda
        params_dtype=torch.float64,
        **settings,
    )


# -- the Megatron run ---------------------------------------------------------------
def megatron_run(rank: int, world: int, tp: int, opts: dict) -> dict:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        return train(tp, world // tp, dict(opts))
    finally:
        parallel_state.destroy_model_parallel()


def train(tp: int, dp: int, opts: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_rank, dp_rank = ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()
    # perform_initialization=False leaves partition_dim unset: the class says then
    init = opts.pop("perform_initialization", True)
    net = Megatron(config(tp, perform_initialization=init), opts.pop("skip_bias_add", False))
    net.load(Dense(), tp_rank, tp)
    opt = torch.optim.SGD(net.parameters(), lr=LR, foreach=False)
    topology = None
    if dp > 1:
        topology = Topology(
            dp=ps.get_data_parallel_group(), tp=ps.get_tensor_model_parallel_group()
        )
    precond = KFACPreconditioner(
        net, optimizer=opt, topology=topology, loss_average="batch_and_sequence", **opts
    )
    grads = []
    for x, y in batches(BATCH * dp):
        part = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
        opt.zero_grad()
        out = net(x[part].transpose(0, 1).contiguous())  # Megatron's [s, b, h]
        loss_of(out, y[part]).backward()
        for p in net.parameters():  # average over the data-parallel group by hand
            if dp > 1:
                dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                p.grad /= dp
        precond.step()
        grads.append(full_grads(net, tp))
        opt.step()
    return {"grads": grads, "layers": list(precond.layers), "describe": precond.describe()}


def full_grads(net: Megatron, tp: int) -> dict[str, Tensor]:
    """Every parameter's whole gradient: the shards gathered over the tp group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dims = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    out = {}
    for name, p in net.named_parameters():
        grad = p.grad.clone()
        if name in dims and tp > 1:
            parts = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(parts, grad, group=ps.get_tensor_model_parallel_group())
            grad = torch.cat(parts, dim=dims[name])
        out[name] = grad
    return out


def dense_run(n: int, opts: dict) -> list[dict[str, Tensor]]:
    net = Dense()
    opt = torch.optim.SGD(net.parameters(), lr=LR, foreach=False)
    precond = KFACPreconditioner(net, optimizer=opt, loss_average="batch_and_sequence", **opts)
    grads = []
    for x, y in batches(n):
        opt.zero_grad()
        loss_of(net(x), y).backward()
        precond.step()
        grads.append({k: p.grad.clone() for k, p in net.named_parameters()})
        opt.step()
    return grads


def assert_equal(results: list[dict], ref: list[dict[str, Tensor]]) -> None:
    for rank, got in enumerate(results):
        for step, (g, r) in enumerate(zip(got["grads"], ref)):
            for name in r:
                err = float((g[name] - r[name]).norm() / r[name].norm())
                assert err <= TOL, f"rank {rank} step {step} {name}: {err}"


# -- tests --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "tp", "extra"),
    [
        (2, 2, dict(factor_update_steps=1, inv_update_steps=2)),
        (2, 2, dict(factor_update_steps=2, inv_update_steps=2, skip_bias_add=True)),
        (2, 2, dict(inv_update_steps=1, perform_initialization=False)),
        (4, 2, dict(factor_update_steps=1, inv_update_steps=2, grad_worker_fraction=0.5)),
        (1, 1, dict(inv_update_steps=2, skip_bias_add=True)),
    ],
    ids=["tp2", "tp2-skip-bias-add", "tp2-no-partition-dim", "dp2xtp2-f0.5", "tp1"],
)
def test_exact_equals_the_dense_run(world: int, tp: int, extra: dict) -> None:
    opts = dict(KW, **extra)
    results = run_distributed(world, megatron_run, tp, opts, timeout_s=90, pg_timeout_s=30)
    opts.pop("skip_bias_add", None)
    opts.pop("perform_initialization", None)
    assert_equal(results, dense_run(BATCH * (world // tp), opts))
    if tp > 1:  # each sharded layer on one primary; the replicated head on every tp rank
        assert results[0]["layers"] != results[1]["layers"]
        assert all("head" in r["layers"] for r in results)
        assert "exact on tp rank" in results[0]["describe"] + results[1]["describe"]
    else:
        assert "ColumnParallelLinear(A: 6×6, G: 8×8) from Megatron-core" in results[0]["describe"]


def test_block_equals_its_definition() -> None:
    opts = dict(KW, tensor_parallel="block", inv_update_steps=2, skip_bias_add=True)
    results = run_distributed(2, megatron_run, 2, opts, timeout_s=90, pg_timeout_s=30)
    data = batches(BATCH)
    assert_equal(results, block_reference(Dense(), data, 2, inv_every=2))
    assert "block of tp rank" in results[0]["describe"]


REFUSED = {
    "sequence_parallel": ({"sequence_parallel": True}, {}),
    "gather_output": ({}, {"gather_output": True}),
    "input_is_parallel": ({}, {"input_is_parallel": False}),
    "main_grad": ({}, {}),  # what Megatron's DistributedDataParallel adds
}


def refusals(rank: int, world: int) -> dict[str, str]:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    try:
        for setting, (cfg, layer) in REFUSED.items():
            net = Megatron(config(world, **cfg), skip_bias_add=False, **layer)
            if setting == "main_grad":
                net.fc2.weight.main_grad = torch.zeros_like(net.fc2.weight)  # type: ignore[attr-defined]
            try:
                KFACPreconditioner(net)
                out[setting] = "no error"
            except NotImplementedError as exc:
                out[setting] = str(exc)
    finally:
        parallel_state.destroy_model_parallel()
    return out


def test_unsupported_settings_are_refused_by_name() -> None:
    for messages in run_distributed(2, refusals, timeout_s=60, pg_timeout_s=20):
        for setting, message in messages.items():
            assert setting in message and "skip_layers" in message, message
