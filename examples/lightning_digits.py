"""K-FAC in a Lightning Trainer: scikit-learn's digits, an MLP, SGD + KFACCallback.

    python examples/lightning_digits.py --steps 200 --accumulate 2

Under torchrun, add ``--devices N`` (Lightning's DDP strategy joins the job).
Nothing is downloaded: the digits ship with scikit-learn.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from kaisa.integrations.lightning import KFACCallback


class DigitsMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        accumulate_grad_batches=args.accumulate,
        callbacks=[KFACCallback(damping=0.03, factor_update_steps=1, inv_update_steps=10)],
        logger=False,
        enable_checkpointing=False,
    )
    model = DigitsMLP()
    trainer.fit(model, loader)
    with torch.no_grad():
        accuracy = (model.net(x).argmax(1) == y).float().mean().item()
    print(f"train accuracy after {args.steps} steps: {accuracy:.3f}")


if __name__ == "__main__":
    main()
