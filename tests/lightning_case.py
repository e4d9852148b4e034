"""The framework case (:mod:`framework_case`) as a LightningModule; import it
only after ``pytest.importorskip("lightning.pytorch")``."""

from __future__ import annotations

import lightning.pytorch as pl
import torch.nn.functional as F

from framework_case import make_net, make_optimizer


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return make_optimizer(self)
