"""K-FAC with Hugging Face accelerate: the recipe, on scikit-learn's digits.

    python examples/accelerate_digits.py --steps 200 --accumulate 2
    torchrun --nproc_per_node=2 examples/accelerate_digits.py   # CPU: Accelerator(cpu=True)

``precond.step()`` runs only when ``accelerator.sync_gradients`` is true (the
accumulation boundary, after the gradients are averaged), before
``optimizer.step()``.  Nothing is downloaded.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch import nn

from kaisa import KFACPreconditioner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accumulate", type=int, default=1)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True
    )
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    precond = KFACPreconditioner(
        model,
        optimizer=optimizer.optimizer,
        accumulation_steps=args.accumulate,
        damping=0.03,
        inv_update_steps=10,
    )
    while precond.steps < args.steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(xb), yb))
                if accelerator.sync_gradients:
                    precond.step()
                optimizer.step()
                optimizer.zero_grad()
            if precond.steps >= args.steps:
                break
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    accelerator.print(f"train accuracy after {args.steps} steps: {accuracy:.3f}")


if __name__ == "__main__":
    main()
