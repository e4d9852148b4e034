"""How well ``kaisa plan`` predicts K-FAC's step overhead on this machine.

For each model of ``step-cost`` (:data:`kaisa_lab.bench.costs.models.STEP_MODELS`,
one process) and three settings, the planner predicts the time K-FAC adds
to a step (:func:`kaisa.planner.forecast.forecast`) from a cost model
measured here (:func:`kaisa.planner.costs.measure_costs`: eigh, Cholesky
inverse, matrix-product rate, copy bandwidth) and the rows a probe forward
counts (:func:`kaisa.planner.probe.probe_rows`); the measured overhead is
the K-FAC step less the plain SGD step, the two models trained in turns
(:func:`~kaisa_lab.bench.timer.interleave`, one step each). The overhead is
also split by stage beside the planner's stage of the same name, so a
wrong prediction points at the stage that is wrong:

- ``capture``: forward+backward with kaisa's hooks less without
  (planner: ``capture``);
- ``reduce + fold``: the statistics reduced and folded into the running
  averages (``factor_comm`` + ``factor_fold``);
- ``decomposition``: decompositions and their broadcast (``decompose`` +
  ``inverse_comm``);
- ``application``: preconditioning, KL clip, write-back (``precondition`` +
  ``grad_comm``);
- ``rest``: what the phases leave of the measured overhead (predicted 0).

The phases are the step's own (:class:`kaisa.step.profile.StepProfile`,
with the same clock). The timed window holds a whole number of inverse
intervals (at least ``steps``), so decompositions are amortised as the
planner amortises them; each of ``repeats`` windows gives a mean per step,
and the median over them is reported.

On a machine shared with other jobs wall time measures the neighbours; the
default clock is the process's CPU time (``clock = "cpu"``) with one
thread, for the cost model and the steps alike: what an idle core would
take. ``clock = "wall"`` times the wall clock instead.

    kaisa bench run plan-accuracy
    kaisa bench report plan-accuracy --table stages --plot plan-accuracy.png
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kaisa import KFACPreconditioner
from kaisa.planner.costs import measure_costs
from kaisa.planner.forecast import forecast, layer_costs
from kaisa.planner.probe import probe_rows
from kaisa.step.profile import APPLY, DECOMPOSE, FOLD, REDUCE, StepProfile
from kaisa_lab.bench.costs.models import STEP_MODELS
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register

__all__ = ["CLOCKS", "SETTINGS", "STAGES"]

SETTINGS: dict[str, dict[str, Any]] = {
    "eigen f=1 inv=10": dict(factor_update_steps=1, inv_update_steps=10, compute_method="eigen"),
    "f=10 inv=100": dict(factor_update_steps=10, inv_update_steps=100),
    "inverse f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="inverse"
    ),
}
#: measured stage -> (the profile's phases, the planner's stages)
STAGES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "capture": ((), ("capture",)),
    "reduce + fold": ((REDUCE, FOLD), ("factor_comm", "factor_fold")),
    "decomposition": ((DECOMPOSE,), ("decompose", "inverse_comm")),
    "application": ((APPLY,), ("precondition", "grad_comm")),
}
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
POOL = 8  # fresh batches in turn: one fixed batch drifts into subnormal floats
WARMUP = 3


class PlanArm:
    """A model with SGD (and K-FAC where ``kfac`` is given): one step per call,
    its forward+backward timed apart with ``clock``."""

    def __init__(
        self, model: str, kfac: Mapping[str, Any] | None, batch: int, clock: Callable[[], float]
    ) -> None:
        torch.manual_seed(0)
        self.model = STEP_MODELS[model]()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.precond = (
            None if kfac is None else KFACPreconditioner(self.model, optimizer=self.opt, **kfac)
        )
        gen = torch.Generator().manual_seed(1)
        self.pool = [
            (
                torch.randn(batch, 1, 28, 28, generator=gen),
                torch.randint(0, 10, (batch,), generator=gen),
            )
            for _ in range(POOL)
        ]
        self.clock = clock
        self.index = 0
        self.fwd_bwd = 0.0

    def __call__(self) -> None:
        x, y = self.pool[self.index % POOL]
        self.index += 1
        t0 = self.clock()
        self.opt.zero_grad()
        F.cross_entropy(self.model(x), y).backward()
        self.fwd_bwd += self.clock() - t0
        if self.precond is not None:
            self.precond.step()
        self.opt.step()


def window(steps: int, inv: int) -> int:
    """At least ``steps``, a whole number of inverse intervals."""
    return inv * math.ceil(steps / inv)


def measure_setting(
    model: str, kfac: Mapping[str, Any], options: Mapping[str, Any], clock: Callable[[], float]
) -> dict[str, float]:
    """Seconds per step, medians over the repeats: both steps, both forward+backwards,
    and the K-FAC step's phases."""
    sgd = PlanArm(model, None, options["batch"], clock)
    arm = PlanArm(model, kfac, options["batch"], clock)
    assert arm.precond is not None
    for _ in range(WARMUP):
        sgd()
        arm()
    steps = window(options["steps"], int(kfac["inv_update_steps"]))
    repeats: list[dict[str, float]] = []
    for _ in range(options["repeats"]):
        sgd.fwd_bwd = arm.fwd_bwd = 0.0
        arm.precond.profile = profile = StepProfile(clock=clock)
        timed = interleave({"sgd": sgd, "kfac": arm}, rounds=steps, warmup=0, clock=clock)
        arm.precond.profile = None
        figures = {
            "sgd_step": timed["sgd"].mean_ms / 1e3,
            "kfac_step": timed["kfac"].mean_ms / 1e3,
            "sgd_forward_backward": sgd.fwd_bwd / steps,
            "kfac_forward_backward": arm.fwd_bwd / steps,
        }
        figures.update(
            {
                phase: profile.seconds.get(phase, 0.0) / steps
                for phase in (REDUCE, FOLD, DECOMPOSE, APPLY)
            }
        )
        repeats.append(figures)
    out = {k: statistics.median(r[k] for r in repeats) for k in repeats[0]}
    out["timed_steps"] = steps
    return out


def measure(options: Mapping[str, Any]) -> list[Row]:
    if options["clock"] not in CLOCKS:
        raise ValueError(f"plan-accuracy: clock {options['clock']!r}; known: {list(CLOCKS)}")
    unknown = [m for m in options["models"] if m not in STEP_MODELS]
    if unknown:
        raise ValueError(f"plan-accuracy: unknown models {unknown}; known: {list(STEP_MODELS)}")
    settings = options["settings"] or list(SETTINGS)
    if set(settings) - set(SETTINGS):
        raise ValueError(f"plan-accuracy: unknown settings; known: {list(SETTINGS)}")
    clock = CLOCKS[options["clock"]]
    cost = measure_costs("cpu", sizes=tuple(options["cost_sizes"]), clock=clock)
    rows = []
    for name in options["models"]:
        rows_counted = probe_rows(
            STEP_MODELS[name](), (torch.randn(1, 1, 28, 28),), scale=options["batch"]
        )
        layers = layer_costs(STEP_MODELS[name](), rows_counted)
        for setting in settings:
            kfac = SETTINGS[setting]
            predicted = forecast(layers, 1, cost, **kfac)
            m = measure_setting(name, kfac, options, clock)
            pred_ms = 1e3 * float(predicted.overhead()[0])
            meas_ms = 1e3 * (m["kfac_step"] - m["sgd_step"])
            sgd_ms = 1e3 * m["sgd_step"]
            stages = {}
            for stage, (phases, planned) in STAGES.items():
                if phases:
                    measured = 1e3 * sum(m[p] for p in phases)
                else:  # capture: forward+backward with the hooks less without
                    measured = 1e3 * (m["kfac_forward_backward"] - m["sgd_forward_backward"])
                stages[stage] = {
                    "measured_ms": measured,
                    "predicted_ms": 1e3 * sum(float(predicted.seconds[k][0]) for k in planned),
                }
            stages["rest"] = {
                "measured_ms": meas_ms - sum(s["measured_ms"] for s in stages.values()),
                "predicted_ms": 0.0,
            }
            result = {
                "median_ms": meas_ms,
                "timed_steps": m["timed_steps"],
                "sgd_ms": sgd_ms,
                "measured_overhead_ms": meas_ms,
                "predicted_overhead_ms": pred_ms,
                "measured_step_ms": 1e3 * m["kfac_step"],
                "predicted_step_ms": sgd_ms + pred_ms,
                "step_error": (sgd_ms + pred_ms) / (1e3 * m["kfac_step"]) - 1,
                "overhead_error": pred_ms / meas_ms - 1 if meas_ms > 0 else None,
                "stages": stages,
                "cost": vars(cost),
            }
            config = {
                "model": name, "setting": setting, "kfac": kfac, "batch": options["batch"],
                "clock": options["clock"],
            }  # fmt: skip
            rows.append(Row(f"{name} {setting}", config, result))
    return rows


# -- reports ---------------------------------------------------------------------------

Records = Sequence[Mapping[str, Any]]


def accuracy_table(records: Records) -> str:
    """Per model and setting: SGD's step, the measured and predicted overhead, the errors."""
    lines = [
        "| model | setting | SGD step (ms) | overhead measured (ms) | predicted (ms) "
        "| step error | overhead error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        c, res = r["config"], r["result"]
        over = res["overhead_error"]
        lines.append(
            f"| {c['model']} | {c['setting']} | {res['sgd_ms']:.1f} | "
            f"{res['measured_overhead_ms']:.1f} | {res['predicted_overhead_ms']:.1f} | "
            f"{100 * res['step_error']:+.1f}% | "
            f"{'-' if over is None else f'{100 * over:+.0f}%'} |"
        )
    return "\n".join(lines) + "\n"


def stages_table(records: Records) -> str:
    """Per model and setting: each stage measured / predicted (ms per step)."""
    names = [*STAGES, "rest"]
    lines = [
        "| model | setting | " + " | ".join(f"{s} (ms)" for s in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in records:
        c, st = r["config"], r["result"]["stages"]
        cells = " | ".join(
            f"{st[s]['measured_ms']:.1f} / {st[s]['predicted_ms']:.1f}" for s in names
        )
        lines.append(f"| {c['model']} | {c['setting']} | {cells} |")
    return "\n".join(lines) + "\n" + "\nmeasured / predicted\n"


def plot(records: Records, path: Path) -> None:
    """Predicted against measured step time, one point per model and setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for r in records:
        res = r["result"]
        ax.scatter(res["measured_step_ms"], res["predicted_step_ms"])
        ax.annotate(
            f"{r['config']['model'][:3]} {r['config']['setting']}",
            (res["measured_step_ms"], res["predicted_step_ms"]),
            fontsize=6,
        )
    top = 1.1 * max(
        max(r["result"]["measured_step_ms"], r["result"]["predicted_step_ms"]) for r in records
    )
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="plan-accuracy",
        description="the planner's predicted K-FAC overhead against the measured one, "
        "per model, setting and stage",
        measure=measure,
        options={
            "models": list(STEP_MODELS),
            "settings": None,  # all of SETTINGS
            "steps": 30,
            "batch": 128,
            "repeats": 3,
            "clock": "cpu",
            "cost_sizes": [128, 256, 512, 1024, 2048],
        },
        quick={
            "models": ["mlp-784-512-512-10"],
            "settings": ["eigen f=1 inv=10"],
            "steps": 10,
            "batch": 16,
            "repeats": 1,
            "cost_sizes": [64, 128, 256],
        },
        tables={"accuracy": accuracy_table, "stages": stages_table},
        plot=plot,
    )
)
