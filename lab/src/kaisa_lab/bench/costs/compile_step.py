"""kaisa under ``torch.compile``: graphs, graph breaks and step time.

Per model of :func:`kaisa_lab.bench.costs.models.compile_models` — a small CNN
(``cnn``), a 2-block Transformer LM with plain ``nn.Linear`` projections
(``lm-2x128``), a 12-block one of identical blocks (``lm-12x64``) and the
2-block LM built from ``nn.TransformerEncoderLayer`` (``mha-2x128``) —
with kaisa attached before compiling, as the README says:

- **graphs** (deterministic): how many compiled graphs one forward runs, on
  a factor step and on a non-factor step, how many dynamo compiled in all,
  the graph breaks it recorded, and how many of kaisa's registered layers
  the compiled steps captured — without kaisa and with it (counted with a
  backend that counts its calls around ``aot_eager``; factors every 2
  steps). Inside a compiled region each layer's output passes through an
  autograd function whose backward forms the layer's terms, so the compiled
  forward is one graph on factor and non-factor steps (two variants, each
  compiled once), with no break, and ``nn.MultiheadAttention``'s projections
  are captured through kaisa's own attention under compile.
- **step time** (with ``timed``): four arms — eager, eager + kaisa,
  compiled, compiled + kaisa — in turns
  (:func:`~kaisa_lab.bench.timer.interleave`, ``rounds`` × ``block`` steps
  after a warm-up that compiles both variants; the first step of each arm,
  its cold compile, is kept apart), at factor/inverse intervals
  ``factor_steps``/``inv_steps`` (10/100: a block of 10 holds one factor
  step); the ratio that matters is compiled + kaisa / eager + kaisa against
  compiled / eager: kaisa's share of the step must not grow under compile.

``device="cuda"`` runs the same on a GPU (inductor's Triton kernels; each
step synchronised before its clock stops).

    kaisa bench run compile-step
    kaisa bench run compile-step --option timed=false     # the graph counts alone (fast)
    kaisa bench report compile-step --table graphs
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kaisa import KFACPreconditioner
from kaisa_lab.bench.costs.models import CompileModel, compile_models, loss_of
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register

__all__ = ["ARMS", "CompileArm", "graph_counts"]

ARMS = ("eager", "eager+kaisa", "compiled", "compiled+kaisa")
#: the graph counts a record keeps (deterministic)
GRAPH_FIELDS = (
    "graphs_factor_step",
    "graphs_other_step",
    "graphs_compiled",
    "graph_breaks",
    "layers_captured",
    "layers",
)


class CompileArm:
    """One model, SGD and (optionally) kaisa, compiled or not: a step per call."""

    def __init__(
        self,
        name: str,
        model: CompileModel,
        kfac: Mapping[str, Any] | None,
        compiled: bool,
        device: torch.device,
        backend: str,
    ) -> None:
        self.device = device
        torch.manual_seed(0)
        self.model = model[0]().to(device)
        self.data = model[1]
        self.g = torch.Generator().manual_seed(1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.precond = None if kfac is None else KFACPreconditioner(self.model, **kfac)
        if compiled:
            # a class of its own: dynamo does not guard on module hooks by
            # default, so a second model of the same class would reuse the
            # first one's compiled code (with or without kaisa's hooks)
            cls = type(self.model)
            safe = "".join(c if c.isalnum() else "_" for c in name)
            self.model.__class__ = type(f"{cls.__name__}_{safe}", (cls,), {})
        self.forward: Callable[[Tensor], Tensor] = (
            torch.compile(self.model, backend=backend) if compiled else self.model
        )

    def __call__(self) -> None:
        x, y = (t.to(self.device) for t in self.data(self.g))
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.forward(x), y).backward()
        if self.precond is not None:
            self.precond.step()
        self.opt.step()


def graph_counts(
    model: CompileModel, kfac: Mapping[str, Any] | None, device: torch.device
) -> dict[str, int]:
    """Graphs run per forward on a factor step and on a non-factor step, graphs
    compiled, graph breaks, and how many of kaisa's layers the compiled steps
    captured (of how many registered)."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled: list[int] = []
    runs = [0]

    def backend(gm: torch.fx.GraphModule, example: list[Tensor]) -> Callable[..., Any]:
        compiled.append(1)
        fn = lookup_backend("aot_eager")(gm, example)

        def run(*args: Any) -> Any:
            runs[0] += 1
            return fn(*args)

        return run

    torch.manual_seed(0)
    net = model[0]().to(device)
    every_other = None if kfac is None else {**kfac, "factor_update_steps": 2}
    precond = None if every_other is None else KFACPreconditioner(net, **every_other)
    forward = torch.compile(net, backend=backend)
    g = torch.Generator().manual_seed(1)
    per_step = []
    for _ in range(2):  # a factor step, then a non-factor step
        before = runs[0]
        x, y = (t.to(device) for t in model[1](g))
        loss_of(forward(x), y).backward()
        per_step.append(runs[0] - before)
        if precond is not None:
            precond.step()
        net.zero_grad()
    layers = {} if precond is None else precond.layers
    counts = {
        "graphs_factor_step": per_step[0],
        "graphs_other_step": per_step[1],
        "graphs_compiled": len(compiled),
        "graph_breaks": sum(counters["graph_break"].values()),
        "layers_captured": sum(layer.captured for layer in layers.values()),
        "layers": len(layers),
    }
    if precond is not None:
        precond.remove_hooks()
    torch._dynamo.reset()
    return counts


def measure(options: Mapping[str, Any]) -> list[Row]:
    device = torch.device(options["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("compile-step: device=cuda, but torch sees no GPU")
    models = compile_models(options["batch"])
    unknown = [m for m in options["models"] if m not in models]
    if unknown:
        raise ValueError(f"compile-step: unknown models {unknown}; known: {list(models)}")
    kfac = dict(
        factor_update_steps=options["factor_steps"],
        inv_update_steps=options["inv_steps"],
        damping=0.01,
    )
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    rows = []
    for name in options["models"]:
        model = models[name]
        graphs = {
            "compiled": graph_counts(model, None, device),
            "compiled+kaisa": graph_counts(model, kfac, device),
        }
        if not options["timed"]:
            for arm, counts in graphs.items():
                config = {"model": name, "arm": arm, "kfac": kfac if "kaisa" in arm else None}
                rows.append(Row(f"{name} {arm}", config, counts))
            continue
        arms = {
            arm: CompileArm(
                f"{name} {arm}", model, kfac if "kaisa" in arm else None,
                arm.startswith("compiled"), device, options["backend"],
            )
            for arm in ARMS
        }  # fmt: skip
        first_s: dict[str, float] = {}
        for arm, step in arms.items():  # warm-up: the cold compile, then both variants
            if sync is not None:
                sync()
            start = time.perf_counter()
            step()
            if sync is not None:
                sync()
            first_s[arm] = time.perf_counter() - start
            for _ in range(options["block"]):
                step()
        timed = interleave(
            dict(arms), rounds=options["rounds"], block=options["block"], warmup=0, sync=sync
        )
        parameters = sum(p.numel() for p in arms["eager"].model.parameters())
        for arm, timing in timed.items():
            # what the arm is (batch, backend, device: the run's options); the graph
            # counts do not depend on them
            config = {"model": name, "arm": arm, "kfac": kfac if "kaisa" in arm else None}
            result: dict[str, Any] = {
                **timing.summary(),
                "first_step_s": first_s[arm],
                "parameters": parameters,
            }
            result.update(graphs.get(arm, {}))
            rows.append(Row(f"{name} {arm}", config, result))
        torch._dynamo.reset()
    return rows


def _by_model(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Mapping[str, Any]]]:
    out: dict[str, dict[str, Mapping[str, Any]]] = {}
    for r in records:
        out.setdefault(r["config"]["model"], {})[r["config"]["arm"]] = r["result"]
    order = list(compile_models(1))
    return dict(sorted(out.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99))


def graphs_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Per model: graphs per forward without and with kaisa (factor / other step),
    graphs compiled, graph breaks, and the layers the compiled steps captured."""
    lines = [
        "| model | graphs/forward plain | with kaisa (factor / other step) "
        "| graphs compiled plain / kaisa | breaks plain / kaisa | layers captured |",
        "|---|---|---|---|---|---|",
    ]
    for model, arms in _by_model(records).items():
        p, k = arms.get("compiled"), arms.get("compiled+kaisa")
        if p is None or k is None or "graphs_factor_step" not in k:
            continue
        lines.append(
            f"| {model} | {p['graphs_factor_step']} | {k['graphs_factor_step']} / "
            f"{k['graphs_other_step']} | {p['graphs_compiled']} / {k['graphs_compiled']} | "
            f"{p['graph_breaks']} / {k['graph_breaks']} | "
            f"{k['layers_captured']} / {k['layers']} |"
        )
    return "\n".join(lines) + "\n"


def time_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Per model: each arm's mean step (ms; factor steps amortised) and the ratios
    compiled / eager and compiled + kaisa / eager + kaisa."""
    lines = [
        "| model | eager ms | eager + kaisa | compiled | compiled + kaisa | compiled / eager "
        "| compiled + kaisa / eager + kaisa | first compiled step (s): plain / kaisa |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, arms in _by_model(records).items():
        if not all(arm in arms and "mean_ms" in arms[arm] for arm in ARMS):
            continue
        ms = {arm: arms[arm]["mean_ms"] for arm in ARMS}
        lines.append(
            f"| {model} | {ms['eager']:.1f} | {ms['eager+kaisa']:.1f} | {ms['compiled']:.1f} | "
            f"{ms['compiled+kaisa']:.1f} | {ms['compiled'] / ms['eager']:.2f} | "
            f"{ms['compiled+kaisa'] / ms['eager+kaisa']:.2f} | "
            f"{arms['compiled']['first_step_s']:.1f} / "
            f"{arms['compiled+kaisa']['first_step_s']:.1f} |"
        )
    if len(lines) == 2:
        return "no step times in this measurement (option timed)\n"
    return "\n".join(lines) + "\n"


def plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Per model, the four arms' mean steps (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = {m: arms for m, arms in _by_model(records).items() if all(a in arms for a in ARMS)}
    models = {m: arms for m, arms in models.items() if all("mean_ms" in arms[a] for a in ARMS)}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, arm in enumerate(ARMS):
        xs = [j + (i - 1.5) * width for j in range(len(models))]
        ax.bar(xs, [arms[arm]["mean_ms"] for arms in models.values()], width, label=arm)
    ax.set_xticks(range(len(models)), list(models))
    ax.set_ylabel("ms per step (mean)")
    ax.set_title("kaisa under torch.compile")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="compile-step",
        description="kaisa under torch.compile: graphs and breaks per forward, and eager / "
        "compiled step time with and without kaisa, interleaved",
        measure=measure,
        options={
            "models": ["cnn", "lm-2x128", "lm-12x64", "mha-2x128"],
            "batch": 32,
            "rounds": 5,
            "block": 10,
            "factor_steps": 10,
            "inv_steps": 100,
            "timed": True,
            "backend": "inductor",
            "device": "cpu",
        },
        quick={"models": ["cnn"], "batch": 4, "rounds": 1, "block": 2, "backend": "aot_eager"},
        tables={"graphs": graphs_table, "time": time_table},
        plot=plot,
        device="any",
        deterministic=GRAPH_FIELDS,
    )
)
