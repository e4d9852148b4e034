"""K-FAC with DeepSpeed ZeRO, on scikit-learn's digits.

    torchrun --nproc_per_node=2 examples/deepspeed_digits.py --steps 100
    python examples/deepspeed_digits.py --stage 3 --bf16      # one process

``KFACPreconditioner(ds_engine)`` reads the accumulation count, the learning
rate and (fp16) the loss scale from the engine.  ``precond.step()`` runs on
the accumulation boundary, after ``ds_engine.backward(loss)`` and before
``ds_engine.step()``.  The config (``deepspeed_config.json``) sets
``gradient_clipping`` to 0: DeepSpeed's default of 1.0 clips *after* kaisa and
on top of its KL clip, which already bounds the update.  Runs on CPU with the
gloo backend; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(key, value)  # one process without a launcher
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch import nn  # noqa: E402

from kaisa import KFACPreconditioner  # noqa: E402

CONFIG = Path(__file__).with_name("deepspeed_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--stage", type=int, default=None, help="ZeRO stage (config: 2)")
    parser.add_argument("--bf16", action="store_true", help="bf16 weights and activations")
    parser.add_argument("--config", type=Path, default=CONFIG)
    args = parser.parse_args()
    config = json.loads(args.config.read_text())
    if args.stage is not None:
        config["zero_optimization"]["stage"] = args.stage
    if args.bf16:
        config["bf16"] = {"enabled": True}
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = torch.utils.data.DistributedSampler(dataset, seed=0)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=config["train_micro_batch_size_per_gpu"], sampler=sampler
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    precond = KFACPreconditioner(engine, damping=0.03, inv_update_steps=10)

    epoch = 0
    while precond.steps < args.steps:
        sampler.set_epoch(epoch)
        epoch += 1
        for xb, yb in loader:
            loss = F.cross_entropy(
                engine(xb.to(engine.device, dtype)).float(), yb.to(engine.device)
            )
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                precond.step()
            engine.step()
            if precond.steps >= args.steps:
                break
    with torch.no_grad():
        accuracy = (engine(x.to(engine.device, dtype)).argmax(1).cpu() == y).float().mean().item()
    if dist.get_rank() == 0:
        print(f"train accuracy after {args.steps} steps: {accuracy:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
