"""A factor's Gram ``xᵀ x``: one matrix product against ``kaisa.core.statistics.gram``.

``kaisa.core.statistics.gram`` forms a tall CPU Gram by blocks (the 6 blocks on and
above the diagonal of a 3 × 3 grid, the others as their transposes) because
torch exposes no ``syrk``.  This times both on the shapes K-FAC meets: an
MLP's batch of 128 rows, and a convolution's patch chunks of thousands of
rows.  Median of ``--repeats`` runs after one warm-up; table on stdout,
``gram.json`` and ``gram.png`` under ``--out``.  Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from conv_capture import median_ms  # the same timer as the capture benchmark
from kaisa.core.statistics import gram

SHAPES = [(128, 513), (128, 785), (512, 513), (1024, 257), (1024, 513), (1800, 577), (7000, 290)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'rows x width':>14} {'one product ms':>15} {'kaisa gram ms':>14} {'speed-up':>9}")
    for n, d in SHAPES:
        x = torch.randn(n, d)
        one = median_ms(lambda x=x: x.t() @ x, args.repeats)
        ours = median_ms(lambda x=x: gram(x), args.repeats)
        rows.append({"rows": n, "width": d, "one_product_ms": one, "gram_ms": ours})
        print(f"{f'{n} x {d}':>14} {one:15.3f} {ours:14.3f} {one / ours:9.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats}
    (args.out / "gram.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['rows']}×{r['width']}" for r in rows]
    ax.bar(labels, [r["one_product_ms"] / r["gram_ms"] for r in rows])
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_ylabel("speed-up over one product")
    ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    fig.savefig(args.out / "gram.png", dpi=120)
    print(f"wrote {args.out / 'gram.json'} and {args.out / 'gram.png'}")


if __name__ == "__main__":
    main()
