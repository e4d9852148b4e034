"""kaisa under ``torch.compile``: graphs, graph breaks and step time (issue 24).

Per model — a small CNN, a 2-block Transformer LM with plain ``nn.Linear``
projections, a 12-block Transformer of identical blocks, and the 2-block LM
built from ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``) — it reports:

* **graphs**: how many compiled graphs one forward runs and how many dynamo
  compiled in all, and the graph breaks it recorded, without kaisa and with
  kaisa attached before compiling (as the README says), on a factor step and
  on a non-factor step;
* **step time** of four arms — eager, eager + kaisa, compiled, compiled +
  kaisa — run in turns (``--rounds`` rounds of ``--block`` steps each, after
  a warm-up that compiles every variant), the median over rounds of each
  round's mean, and the ratios the issue's goal compares:
  compiled+kaisa / eager+kaisa against compiled / eager.

K-FAC runs at factor/inverse intervals 10/100 (``--factor-steps``,
``--inv-steps``), so a block of 10 steps holds one factor step.  The first
forward of each compiled arm (its cold compile) is timed apart.
``--device cuda`` runs the same on a GPU (inductor's Triton kernels; each
block of steps synchronised before its clock stops).

Prints tables, writes ``compile_step.json`` and ``compile_step.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters

from kaisa import KFACPreconditioner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conv_capture import cnn  # the same CNN (3 channels, 32 x 32 inputs)

CPU = torch.device("cpu")


class Block(nn.Module):
    """A pre-norm Transformer block with plain Linear projections."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        h = self.norm1(x)

        def split(z: Tensor) -> Tensor:
            return z.view(n, t, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(n, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, blocks: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class EncoderLM(LM):
    """The LM with ``nn.TransformerEncoderLayer`` blocks (``nn.MultiheadAttention``)."""

    def __init__(self, vocab: int, width: int, heads: int, blocks: int, context: int) -> None:
        super().__init__(vocab, width, heads, 0, context)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(blocks)
        )
        self.register_buffer(
            "causal", torch.ones(context, context).triu(1).bool(), persistent=False
        )

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.shape[1]
        x = self.embed(ids) + self.position[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(x))


Case = tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[Tensor, Tensor]]]


def cases(batch: int) -> dict[str, Case]:
    def images(g: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(
            0, 10, (batch,), generator=g
        )

    def text(g: torch.Generator) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, 96, (batch, 65), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return {
        "cnn": (cnn, images),
        "lm-2x128": (lambda: LM(96, 128, 4, 2, 64), text),
        "lm-12x64": (lambda: LM(96, 64, 4, 12, 64), text),
        "mha-2x128": (lambda: EncoderLM(96, 128, 4, 2, 64), text),
    }


def loss_of(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


class Arm:
    """One model, optimizer and (optionally) preconditioner, stepped in turns."""

    def __init__(
        self,
        name: str,
        case: Case,
        kfac: dict[str, Any] | None,
        compiled: bool,
        device: torch.device = CPU,
    ) -> None:
        self.name = name
        self.device = device
        torch.manual_seed(0)
        self.model = case[0]().to(device)
        self.data = case[1]
        self.g = torch.Generator().manual_seed(1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.precond = None if kfac is None else KFACPreconditioner(self.model, **kfac)
        if compiled:
            # a class of its own: dynamo does not guard on module hooks by
            # default, so a second model of the same class would reuse the
            # first one's compiled code (with or without kaisa's hooks)
            cls = type(self.model)
            self.model.__class__ = type(f"{cls.__name__}_{name}", (cls,), {})
        self.forward = torch.compile(self.model) if compiled else self.model
        self.times: list[float] = []

    def step(self) -> None:
        x, y = (t.to(self.device) for t in self.data(self.g))
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.forward(x), y).backward()
        if self.precond is not None:
            self.precond.step()
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def block(self, steps: int) -> None:
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        self.times.append((time.perf_counter() - start) / steps)


def graph_counts(
    case: Case, kfac: dict[str, Any] | None, device: torch.device = CPU
) -> dict[str, int]:
    """Graphs run per forward (factor and non-factor step), compiled, breaks,
    and how many of kaisa's layers the compiled steps captured."""
    torch._dynamo.reset()
    counters.clear()
    compiled: list[int] = []
    runs = [0]

    def backend(gm: torch.fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
        compiled.append(1)
        from torch._dynamo.backends.registry import lookup_backend

        fn = lookup_backend("aot_eager")(gm, example)

        def run(*args: Any) -> Any:
            runs[0] += 1
            return fn(*args)

        return run

    torch.manual_seed(0)
    model = case[0]().to(device)
    precond = (
        None if kfac is None else KFACPreconditioner(model, **{**kfac, "factor_update_steps": 2})
    )
    forward = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    per_step = []
    for _ in range(2):  # a factor step, then a non-factor step
        before = runs[0]
        x, y = (t.to(device) for t in case[1](g))
        loss_of(forward(x), y).backward()
        per_step.append(runs[0] - before)
        if precond is not None:
            precond.step()
        model.zero_grad()
    breaks = sum(counters["graph_break"].values())
    return {
        "graphs_factor_step": per_step[0],
        "graphs_other_step": per_step[1],
        "compiled": len(compiled),
        "breaks": breaks,
        # registered layers whose statistics the compiled steps captured
        "captured": 0 if precond is None else sum(la.captured for la in precond.layers.values()),
        "layers": 0 if precond is None else len(precond.layers),
    }


def run_case(name: str, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    kfac = dict(
        factor_update_steps=args.factor_steps, inv_update_steps=args.inv_steps, damping=0.01
    )
    device = torch.device(args.device)
    graphs = {
        "plain": graph_counts(case, None, device),
        "kaisa": graph_counts(case, kfac, device),
    }
    torch._dynamo.reset()
    arms = [
        Arm("eager", case, None, False, device),
        Arm("eager+kaisa", case, kfac, False, device),
        Arm("compiled", case, None, True, device),
        Arm("compiled+kaisa", case, kfac, True, device),
    ]
    cold: dict[str, float] = {}
    for arm in arms:  # warm-up: compiles the factor-step and the other variant
        start = time.perf_counter()
        arm.step()
        arm.sync()
        cold[arm.name] = time.perf_counter() - start
        for _ in range(args.block):
            arm.step()
    for _ in range(args.rounds):
        for arm in arms:
            arm.block(args.block)
    ms = {arm.name: 1e3 * statistics.median(arm.times) for arm in arms}
    return {
        "model": name,
        "parameters": sum(p.numel() for p in arms[0].model.parameters()),
        "graphs": graphs,
        "ms_per_step": ms,
        "rounds_ms": {arm.name: [1e3 * t for t in arm.times] for arm in arms},
        "first_step_s": cold,
        "compiled_over_eager": ms["compiled"] / ms["eager"],
        "compiled_kaisa_over_eager_kaisa": ms["compiled+kaisa"] / ms["eager+kaisa"],
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | graphs/forward plain | with kaisa (factor / other step) | breaks plain / kaisa "
        "| layers captured | eager ms | eager+kaisa | compiled | compiled+kaisa | compiled/eager "
        "| compiled+kaisa / eager+kaisa |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, k, ms = r["graphs"]["plain"], r["graphs"]["kaisa"], r["ms_per_step"]
        lines.append(
            f"| {r['model']} | {p['graphs_factor_step']} | {k['graphs_factor_step']} / "
            f"{k['graphs_other_step']} | {p['breaks']} / {k['breaks']} | "
            f"{k['captured']} / {k['layers']} | {ms['eager']:.1f} | "
            f"{ms['eager+kaisa']:.1f} | {ms['compiled']:.1f} | {ms['compiled+kaisa']:.1f} | "
            f"{r['compiled_over_eager']:.2f} | {r['compiled_kaisa_over_eager_kaisa']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["eager", "eager+kaisa", "compiled", "compiled+kaisa"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, arm in enumerate(names):
        xs = [j + (i - 1.5) * width for j in range(len(results))]
        ax.bar(xs, [r["ms_per_step"][arm] for r in results], width, label=arm)
    ax.set_xticks(range(len(results)), [r["model"] for r in results])
    ax.set_ylabel("ms per step (median of rounds)")
    ax.set_title("kaisa under torch.compile (factors every 10 steps, inverses every 100)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "lm-2x128", "lm-12x64"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--factor-steps", type=int, default=10)
    parser.add_argument("--inv-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--graphs-only", action="store_true", help="count graphs, time nothing")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=Path("runs/compile_step"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    all_cases = cases(args.batch)
    unknown = sorted(set(args.models) - set(all_cases))
    if unknown:
        parser.error(f"--models: unknown {unknown}; allowed: {sorted(all_cases)}")
    results = []
    for name in args.models:
        if args.graphs_only:
            kfac = dict(factor_update_steps=2, inv_update_steps=4, damping=0.01)
            graphs = {
                "plain": graph_counts(all_cases[name], None, torch.device(args.device)),
                "kaisa": graph_counts(all_cases[name], kfac, torch.device(args.device)),
            }
            print(name, json.dumps(graphs))
            results.append({"model": name, "graphs": graphs})
            continue
        results.append(run_case(name, all_cases[name], args))
        print(table(results[-1:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compile_step.json").write_text(
        json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1
        )
    )
    if not args.graphs_only:
        if args.device.startswith("cuda"):
            print("device:", torch.cuda.get_device_name(), "torch", torch.__version__)
        print(table(results))
        plot(results, args.out / "compile_step.png")


if __name__ == "__main__":
    main()
