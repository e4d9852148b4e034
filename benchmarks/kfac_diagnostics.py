"""What sets K-FAC's step on text-lm: ν, the factors' spectra, ‖V‖/‖∇‖ (issue 23, item 2).

Runs the real ``kaisa train`` in-process (any of its options after ``--``)
and, read-only, logs around every K-FAC step:

* the KL clip's ν (:class:`kaisa.step.diagnostics.StepDiagnostics`; None
  where the clip is off);
* per layer ``‖V‖/‖∇‖`` and ``cos(V, ∇)`` — ``∇`` the layer's gradient matrix
  before the step, ``V`` the preconditioned one it wrote (``ν·V`` divided by
  ν);
* at every inverse update (and the first step), per layer the eigenvalues of
  the running A and G (``eigvalsh``; a diagonal factor's entries): min /
  median / max, the fraction of products ``λ_G·λ_A`` below the damping γ,
  ``γ / mean(λ_G·λ_A)``, and for the inverse method's factored damping
  (``A + π√γ I``, ``G + √γ/π I``, ``π² = (tr A/d_A)/(tr G/d_G)``) the fraction
  of each factor's eigenvalues below its share.

Writes ``OUT.json`` (every record), ``OUT.png`` (ν and ``‖V‖/‖∇‖`` over steps,
the spectra per layer at the last inverse update) and a Markdown table on
stdout::

    python benchmarks/kfac_diagnostics.py --out docs/text-lm-kfac-diagnostics -- \\
        --kfac --task text-lm --threads 1 --evals-per-epoch 10 --stop-at-target
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kaisa.core.specs import FactorKind
from kaisa.step.diagnostics import StepDiagnostics
from kaisa_lab.cli import main as cli_main
from kaisa_lab.cli import train as cli_train


def grad_matrix(layer: Any) -> Tensor | None:
    grads = [p.grad for p in layer.adapter.parameters()]
    if grads[0] is None:
        return None
    return layer.adapter.matrix_of([g.detach().clone() for g in grads]).double()


def eigenvalues(layer: Any, name: str) -> Tensor | None:
    spec = layer.factors[layer.index(name)]
    value = layer.factor(name)
    if value is None:
        return None
    value = value.detach().double()
    if spec.kind is FactorKind.DIAGONAL:
        return value.sort().values
    if spec.kind is FactorKind.BLOCK_DIAGONAL:
        value = spec.layout.dense(value)
    return torch.linalg.eigvalsh(value)


def spectra(layer: Any, damping: float) -> dict[str, Any] | None:
    """The spectra record of one layer (None before its factors exist)."""
    names = [s.name for s in layer.factors]
    if names != ["A", "G"]:
        return None
    lam_a, lam_g = eigenvalues(layer, "A"), eigenvalues(layer, "G")
    if lam_a is None or lam_g is None:
        return None
    products = torch.outer(lam_g, lam_a).reshape(-1)
    pi = math.sqrt(max(float(lam_a.mean()), 1e-30) / max(float(lam_g.mean()), 1e-30))
    share_a, share_g = pi * math.sqrt(damping), math.sqrt(damping) / pi

    def summary(lam: Tensor) -> dict[str, float]:
        return {"min": float(lam.min()), "median": float(lam.median()), "max": float(lam.max())}

    return {
        "A": summary(lam_a),
        "G": summary(lam_g),
        "dims": [lam_a.numel(), lam_g.numel()],
        "below_damping": float((products < damping).double().mean()),
        "damping_over_mean_product": damping / float(products.mean()),
        "pi": pi,
        "A_below_share": float((lam_a < share_a).double().mean()),
        "G_below_share": float((lam_g < share_g).double().mean()),
        "eig_A": lam_a.tolist(),
        "eig_G": lam_g.tolist(),
    }


class Recorder:
    """Wraps a preconditioner's ``step`` to log around it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.inverse: list[dict[str, Any]] = []
        self.config: dict[str, Any] = {}

    def attach(self, precond: Any) -> None:
        precond.diagnostics = diag = StepDiagnostics()
        config = precond.config
        self.config = {
            "damping": config.damping,
            "kl_clip": config.kl_clip,
            "compute_method": str(config.compute_method.value),
            "factor_update_steps": config.factor_update_steps,
            "inv_update_steps": config.inv_update_steps,
            "grafting": None if config.grafting is None else config.grafting.value,
        }
        inner = precond.step

        def step() -> None:
            layers = precond.layers
            before = {name: grad_matrix(la) for name, la in layers.items()}
            inner()
            n = precond.steps
            nu = diag.kl_scales[-1] if diag.kl_scales else None
            scale = 1.0 if nu is None else nu
            per_layer = {}
            for name, la in layers.items():
                g = before[name]
                after = grad_matrix(la)
                if g is None or after is None or float(g.norm()) == 0.0:
                    continue
                v = after / scale if scale > 0 else after
                cos = float((v * g).sum() / (v.norm() * g.norm()).clamp_min(1e-300))
                per_layer[name] = {"v_over_grad": float(v.norm() / g.norm()), "cos": cos}
            self.steps.append({"step": n, "nu": nu, "layers": per_layer})
            inv = config.inv_update_steps
            if n == 1 or (isinstance(inv, int) and (n - 1) % inv == 0):
                damping = float(config.damping)
                layers_out = {name: spectra(la, damping) for name, la in layers.items()}
                self.inverse.append({"step": n, "layers": layers_out})

        precond.step = step


def run(kaisa_args: list[str]) -> Recorder:
    recorder = Recorder()
    original = cli_train._Trainer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # the last preconditioner built is the run's (kaisa train first
        # warms up on a throwaway model): start the records afresh for each
        if self.preconditioner is not None:
            recorder.steps.clear()
            recorder.inverse.clear()
            recorder.attach(self.preconditioner)

    cli_train._Trainer.__init__ = init  # type: ignore[method-assign]
    try:
        cli_main.main(["train", *kaisa_args])
    finally:
        cli_train._Trainer.__init__ = original  # type: ignore[method-assign]
    return recorder


def table(rec: Recorder) -> str:
    """Per layer at the last inverse update: spectra and damping ratios;
    ``‖V‖/‖∇‖`` and ``cos(V, ∇)`` as medians over every step."""
    last = rec.inverse[-1]
    rows = [
        f"At step {last['step']} (damping {rec.config['damping']}, "
        f"{rec.config['compute_method']}); ‖V‖/‖∇‖ and cos(V, ∇): median over all steps.",
        "",
        "| layer | d_A, d_G | λ_A min / median / max | λ_G min / median / max | "
        "λ_Gλ_A < γ | γ / mean λ_Gλ_A | λ_A < π√γ | λ_G < √γ/π | ‖V‖/‖∇‖ | cos(V, ∇) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in last["layers"].items():
        if s is None:
            continue
        ratios = [r["layers"][name]["v_over_grad"] for r in rec.steps if name in r["layers"]]
        coss = [r["layers"][name]["cos"] for r in rec.steps if name in r["layers"]]
        a, g = s["A"], s["G"]
        rows.append(
            f"| {name} | {s['dims'][0]}, {s['dims'][1]} | "
            f"{a['min']:.1e} / {a['median']:.1e} / {a['max']:.1e} | "
            f"{g['min']:.1e} / {g['median']:.1e} / {g['max']:.1e} | "
            f"{s['below_damping']:.2f} | {s['damping_over_mean_product']:.2g} | "
            f"{s['A_below_share']:.2f} | {s['G_below_share']:.2f} | "
            f"{statistics.median(ratios):.3g} | {statistics.median(coss):.2f} |"
        )
    nus = [r["nu"] for r in rec.steps if r["nu"] is not None]
    if nus:
        bound = sum(nu < 1.0 for nu in nus)
        rows.append("")
        rows.append(
            f"ν: clip bound on {bound}/{len(nus)} steps; min {min(nus):.3g}, "
            f"median {statistics.median(nus):.3g}"
        )
    else:
        rows.append("")
        rows.append("ν: KL clip off (ν = 1 on every step)")
    return "\n".join(rows)


def plot(rec: Recorder, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = rec.inverse[-1]
    names = [n for n, s in last["layers"].items() if s is not None]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    steps = [r["step"] for r in rec.steps]
    axes[0].plot(steps, [1.0 if r["nu"] is None else r["nu"] for r in rec.steps])
    axes[0].set(xlabel="step", ylabel="ν (1: not binding)", title="KL clip's ν", ylim=(0, 1.05))
    for name in names:
        xs = [r["step"] for r in rec.steps if name in r["layers"]]
        ys = [r["layers"][name]["v_over_grad"] for r in rec.steps if name in r["layers"]]
        axes[1].semilogy(xs, ys, label=name, lw=0.8)
    axes[1].axhline(1.0 / float(rec.config["damping"]), color="k", ls=":", label="1/γ")
    axes[1].set(xlabel="step", ylabel="‖V‖ / ‖∇‖", title="preconditioned / raw gradient norm")
    axes[1].legend(fontsize=6, ncol=2)
    for i, name in enumerate(names):
        s = last["layers"][name]
        for key, marker in (("eig_A", "o"), ("eig_G", "x")):
            lam = [max(x, 1e-12) for x in s[key]]
            axes[2].semilogx(
                lam,
                [i + (0.15 if key == "eig_G" else -0.15)] * len(lam),
                marker,
                ms=2,
                alpha=0.5,
                color=f"C{i % 10}",
            )
    damping = float(rec.config["damping"])
    axes[2].axvline(damping, color="k", ls=":", label="γ")
    axes[2].axvline(math.sqrt(damping), color="k", ls="--", label="√γ")
    axes[2].set_yticks(range(len(names)), names, fontsize=6)
    axes[2].set(xlabel="eigenvalue (o: A, x: G)", title=f"spectra at step {last['step']}")
    axes[2].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _option(command: list[str], flag: str, default: str) -> str:
    return command[command.index(flag) + 1] if flag in command else default


def summary(paths: list[Path], out: Path) -> str:
    """One row per diagnostics JSON (e.g. one per damping): steps to target
    (read from the run's results.json) and the medians over layers of the
    fraction of products below γ, ``‖V‖/‖∇‖`` and ``cos(V, ∇)``; and a PNG."""
    rows = []
    for path in paths:
        d = json.loads(path.read_text())
        run_dir = Path(d["command"][d["command"].index("--out") + 1])
        runs = json.loads((run_dir / "results.json").read_text())
        last = {n: s for n, s in d["inverse_updates"][-1]["layers"].items() if s}

        def per_layer(key: str, d: dict[str, Any] = d, last: dict[str, Any] = last) -> float:
            return statistics.median(
                statistics.median(r["layers"][n][key] for r in d["steps"] if n in r["layers"])
                for n in last
            )

        nus = [r["nu"] for r in d["steps"] if r["nu"] is not None]
        rows.append(
            {
                "source": str(path),
                "optimizer": _option(d["command"], "--optimizer", "adamw"),
                "lr": _option(d["command"], "--lr", "task's"),
                "damping": d["config"]["damping"],
                "kl_clip": d["config"]["kl_clip"],
                "steps_to_target": runs[0]["steps_to_target"],
                "below_damping": statistics.median(s["below_damping"] for s in last.values()),
                "v_over_grad": per_layer("v_over_grad"),
                "cos": per_layer("cos"),
                "nu_min": min(nus) if nus else None,
                "nu_per_step": [r["nu"] for r in d["steps"]],
                "command": d["command"],
                # per layer at the last inverse update (without the eigenvalue lists)
                "layers": {
                    n: {
                        **{k: v for k, v in s.items() if not k.startswith("eig_")},
                        "v_over_grad_median": statistics.median(
                            r["layers"][n]["v_over_grad"] for r in d["steps"] if n in r["layers"]
                        ),
                        "cos_median": statistics.median(
                            r["layers"][n]["cos"] for r in d["steps"] if n in r["layers"]
                        ),
                    }
                    for n, s in last.items()
                },
            }
        )
    out_json = Path(f"{out}.json")
    out_json.write_text(json.dumps(rows, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    plain = sorted(
        (r for r in rows if r["kl_clip"] is None and r["optimizer"] == "adamw"),
        key=lambda r: r["damping"],
    )
    xs = [r["damping"] for r in plain]
    axes[0].semilogx(xs, [r["steps_to_target"] for r in plain], "o-")
    axes[0].set(xlabel="damping γ", ylabel="steps to 2.5 bits/char", ylim=(0, 400))
    axes[0].axhline(360, color="k", ls=":", label="AdamW (3 seeds)")
    axes[0].legend()
    axes[1].loglog(xs, [r["v_over_grad"] for r in plain], "o-")
    axes[1].set(xlabel="damping γ", ylabel="‖V‖/‖∇‖ (median over layers, steps)")
    axes[2].semilogx(xs, [r["cos"] for r in plain], "o-", label="cos(V, ∇)")
    axes[2].semilogx(xs, [r["below_damping"] for r in plain], "s-", label="λ_Gλ_A < γ")
    axes[2].set(xlabel="damping γ", ylim=(0, 1.05))
    axes[2].legend()
    fig.suptitle("text-lm, AdamW + K-FAC (inverse 10/50, no clip), seed 0: damping changes")
    fig.tight_layout()
    fig.savefig(Path(f"{out}.png"), dpi=110)
    lines = [
        "| base (lr) | damping | KL clip | steps to target | ν min | λ_Gλ_A < γ | ‖V‖/‖∇‖ "
        "| cos(V, ∇) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        nu = "-" if r["nu_min"] is None else f"{r['nu_min']:.3g}"
        lines.append(
            f"| {r['optimizer']} ({r['lr']}) | {r['damping']} | {r['kl_clip']} | "
            f"{r['steps_to_target']} | {nu} | "
            f"{r['below_damping']:.2f} | {r['v_over_grad']:.3g} | {r['cos']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, theirs = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="OUT.json / OUT.png / OUT.md")
    parser.add_argument("--title", default="text-lm: K-FAC diagnostics")
    parser.add_argument(
        "--summary", nargs="+", type=Path, help="summarise these diagnostics JSONs instead"
    )
    args = parser.parse_args(ours)
    if args.summary:
        print(summary(args.summary, args.out))
        return 0
    rec = run(theirs)
    text = table(rec)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text(text + "\n")
    payload = {
        "command": theirs,
        "config": rec.config,
        "steps": rec.steps,
        "inverse_updates": rec.inverse,
    }
    Path(f"{args.out}.json").write_text(json.dumps(payload))
    plot(rec, Path(f"{args.out}.png"), args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
