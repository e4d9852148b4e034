"""A factor's Gram ``xᵀ x``: one matrix product against ``kaisa.core.statistics.gram``.

``gram`` forms a tall CPU Gram by blocks (the 6 blocks on and above the
diagonal of a 3 × 3 grid, the others as their transposes) because torch
exposes no ``syrk``. The case times both forms, in turns, on the shapes
K-FAC meets: an MLP's batch of 128 rows and a convolution's patch chunks of
thousands of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kaisa.core.statistics import gram
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register

SHAPES = ((128, 513), (128, 785), (512, 513), (1024, 257), (1024, 513), (1800, 577), (7000, 290))


def _forms(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    return {"one product": lambda: x.t() @ x, "kaisa gram": lambda: gram(x)}


def measure(options: Mapping[str, Any]) -> list[Row]:
    rows = []
    for n, d in options["shapes"]:
        timed = interleave(_forms(torch.randn(n, d)), rounds=options["rounds"])
        for form, timing in timed.items():
            rows.append(
                Row(f"{n}x{d} {form}", {"rows": n, "width": d, "form": form}, timing.summary())
            )
    return rows


def table(records: Sequence[Mapping[str, Any]]) -> str:
    by_shape: dict[tuple[int, int], dict[str, float]] = {}
    for r in records:
        c = r["config"]
        by_shape.setdefault((c["rows"], c["width"]), {})[c["form"]] = r["result"]["median_ms"]
    lines = [
        "| rows × width | one product (ms) | kaisa gram (ms) | speed-up |",
        "|---|---|---|---|",
    ]
    for (n, d), forms in sorted(by_shape.items()):
        one, ours = forms["one product"], forms["kaisa gram"]
        lines.append(f"| {n} × {d} | {one:.3f} | {ours:.3f} | {one / ours:.2f} |")
    return "\n".join(lines) + "\n"


CASE = register(
    TimingCase(
        name="gram",
        description="a factor's Gram: one product against kaisa's blocked Gram, on K-FAC's shapes",
        measure=measure,
        options={"shapes": [list(s) for s in SHAPES], "rounds": 9},
        quick={"shapes": [[128, 65], [512, 65]], "rounds": 2},
        tables={"speed-up": table},
    )
)
