"""Stand-in for ``torchinfo`` (see README.md): ``summary`` prints the parameter count."""

from __future__ import annotations

from typing import Any

import torch


def summary(model: torch.nn.Module, input_size: Any = None, **kwargs: Any) -> None:
    """Print the model's class and parameter count (the real one runs a forward pass)."""
    count = sum(p.numel() for p in model.parameters())
    print(f"torchinfo stand-in: {type(model).__name__}, input {input_size}, {count} parameters")
