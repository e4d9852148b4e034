"""The first step of a small language model with an untied 32,000-token head,
measured in a process of its own: ``python tests/large_head_case.py plain``
(or ``kfac [KEY=VALUE …]``, options of KFACPreconditioner) prints the peak
resident memory of the step in bytes.

The peak is the kernel's high-water mark of the process's resident set
(``VmHWM``), reset just before the step (``/proc/self/clear_refs`` ``5``),
so it counts what the step holds and allocates on top of what the process
already held — the interpreter, torch, the model and the optimizer — and
nothing from before.  torch allocates outside Python's allocator, so
``tracemalloc`` would not see it; the resident set does, whatever allocates.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, BATCH, SEQ = 32000, 128, 8, 64


class TinyLM(nn.Module):
    """Embedding → two Linear+GELU blocks → an untied Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.Sequential(
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU()
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def high_water_mark() -> int:
    """The process's peak resident set since the last reset, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_high_water_mark() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str]) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = None
    if argv[0] == "kfac":
        from kaisa import KFACPreconditioner

        options = {}
        for item in argv[1:]:
            key, _, value = item.partition("=")
            try:
                options[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                options[key] = value
        precond = KFACPreconditioner(model, loss_average="batch_and_sequence", **options)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH, SEQ))
    reset_high_water_mark()
    logits = model(tokens)
    F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    del logits
    if precond is not None:
        precond.step()
        # the step measured is one that forms and decomposes every factor
        assert all(layer.decomposed for layer in precond.layers.values())
    optimizer.step()
    print(high_water_mark())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
