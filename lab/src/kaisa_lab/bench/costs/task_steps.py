"""The per-step cost of each arm (an optimizer, ± K-FAC) on a built-in task's own
model and batches.

For each task, every arm is built in one process — the task's model, the
arm's optimizer at the task's learning rate, and for an ``opt+kfac`` arm the
preconditioner at the task's K-FAC settings for that arm (``kfac="task"``:
the suite's selection, the library's defaults where it selected none) or at
the library's defaults (``kfac="defaults"``), either updated by
``kfac_kwargs`` — and the arms step in turns
(:func:`~kaisa_lab.bench.timer.interleave`: ``block`` steps of each, ``rounds``
times) on the same batches of the task's training split, so every arm sees
the same load. A block of 10 holds one factor step at the library's
defaults, and 10 rounds one inverse update, so the mean is the amortised
cost of training. ``loss_average`` is always the task's: it says what the
loss is, it is not a tuning choice.

Per arm: wall ms per step (median and mean), CPU ms per step
(``time.process_time``; with one thread close to what the step costs on an
idle core), and for a K-FAC arm ``precond.step()`` alone — its mean, and its
median on the steps that update neither factors nor inverses (9 in 10 at the
defaults). With ``floor``, one more arm in the same turns: the bare kernels
such a plain ``step()`` cannot avoid, each registered layer's ``G⁻¹ ∇ A⁻¹``
and ``⟨V, ∇⟩`` on random tensors of the preconditioner's own factor sizes
(a diagonal factor, an embedding's A, is a vector: a scaling).

On the digits tasks' tiny models (3–8 layers of 8–256 units, batch 64) what
costs is not a kernel but ``step()``'s fixed work per layer (reading,
preconditioning, clipping and writing each gradient): their plain ``step()``
sits at 2–3× its floor, where the text tasks' 2,048 rows per layer bring it
within 1.2–1.35× of its floor and leave the factor steps as the overhead.

    kaisa bench run task-step-cost
    kaisa bench run task-step-cost --option tasks='["text-lm-large"]' \\
        --option arms='["adamw", "muon", "adamw+kfac", "muon+kfac"]' --option block=10
    kaisa bench run task-step-cost --option kfac=defaults --option kfac_kwargs=damping=0.3
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from kaisa import KFACPreconditioner
from kaisa.core.specs import FactorKind
from kaisa.step.profile import DECOMPOSE, PRODUCTS, StepProfile
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register
from kaisa_lab.levers import KFAC_LAYERS, adamw_part_skips
from kaisa_lab.optim.muon import MuonWithAdamW

__all__ = [
    "TaskArm",
    "build_arm",
    "case_arm",
    "floor_blocks",
    "kfac_keywords",
    "parse_kfac_kwargs",
    "task_batches",
]

#: at most this many distinct batches, cycled (each arm sees them in the same order)
MAX_BATCHES = 256


def parse_kfac_kwargs(given: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """K-FAC keywords from a mapping or ``key=value,key=value``: each text value
    parsed as ``kaisa train``'s ``--kfac-<key>`` parses it (``none``, booleans,
    enums), so a typo fails before any step is taken."""
    from kaisa_lab.cli.options import kfac_options

    options = {o.field: o for o in kfac_options() if o.nargs is None}
    if not given:
        return {}
    if isinstance(given, str):
        pairs = []
        for item in filter(None, (part.strip() for part in given.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"kfac_kwargs: expected KEY=VALUE; got {item!r}")
            pairs.append((key.strip(), value.strip()))
    else:
        pairs = list(given.items())
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key not in options:
            raise ValueError(
                f"kfac_kwargs: {key!r} is not a K-FAC keyword; one of {', '.join(sorted(options))}"
            )
        out[key] = options[key].parse(value) if isinstance(value, str) else value
    return out


def kfac_keywords(task: Any, optimizer: str, kfac: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The preconditioner's keywords: the task's for the K-FAC arm on ``optimizer``
    (``kfac="task"``) or none (``"defaults"``: the library's), then ``extra``;
    ``loss_average`` the task's."""
    if kfac not in ("task", "defaults"):
        raise ValueError(f"kfac: 'task' or 'defaults'; got {kfac!r}")
    base = task.kfac_for(optimizer) if kfac == "task" else {}
    return {"loss_average": task.loss_average, **base, **extra}


def task_batches(data: Any, order: Tensor, size: int, wanted: int) -> list[Any]:
    """Up to ``wanted`` (at most :data:`MAX_BATCHES`) consecutive batches of
    ``size`` from the training split in ``order``, which the arms cycle through."""
    count = min(MAX_BATCHES, wanted, len(order) // size)
    return [data.train.get_batch(order[i * size : (i + 1) * size]) for i in range(count)]


def _updates(value: Any, step: int) -> bool:
    """Whether an interval option (a number or a callable of the step) updates at ``step``."""
    every = value(step) if callable(value) else value
    return step % int(every) == 0


class TaskArm:
    """One arm on a task: a training step per call, on the next shared batch
    (``batches`` on ``device``, where the model is built); times
    ``precond.step()`` and the process's CPU time as it goes; after
    :meth:`time_parts`, also the parts of its step that data-parallel ranks
    can split among themselves (:meth:`parts_ms`).

    ``lever``: a case arm's lever run fields (:mod:`kaisa_lab.levers`) the
    step carries: ``position_fraction``, ``muon_ns_steps`` and
    ``kfac_layers`` (the levers that change what a step costs without a
    pass of their own)."""

    #: the lever run fields a timed step can carry
    LEVERS = ("position_fraction", "muon_ns_steps", "kfac_layers")

    def __init__(
        self,
        task: Any,
        name: str,
        keywords: Mapping[str, Any] | None,
        batches: list[Any],
        device: str = "cpu",
        lever: Mapping[str, Any] | None = None,
    ):
        from kaisa_lab.optim.build import build_optimizer

        lever = dict(lever or {})
        if unknown := sorted(set(lever) - set(self.LEVERS)):
            raise ValueError(f"lever(s) {unknown} are not timed here; choose from {self.LEVERS}")

        optimizer, _, kfac = name.partition("+")
        if kfac not in ("", "kfac"):
            raise ValueError(f"arm {name!r}: an optimizer, or an optimizer + 'kfac'")
        d = task.defaults
        torch.manual_seed(0)
        self.task = task
        self.model = task.build_model().to(device)
        self.opt = build_optimizer(
            optimizer,
            self.model,
            lr=task.arm(bool(kfac), optimizer)[0],
            weight_decay=d.decay(optimizer),
            momentum=d.momentum,
            adamw_lr=d.base_lr("adamw"),
            adamw_weight_decay=d.decay("adamw"),
            muon_ns_steps=lever.get("muon_ns_steps", 5),
        )
        fraction = lever.get("position_fraction")
        if fraction is not None and not kfac:
            raise ValueError("position_fraction: a K-FAC arm's lever")
        layers = lever.get("kfac_layers", "all")
        on_muon = isinstance(self.opt, MuonWithAdamW)
        if layers not in KFAC_LAYERS or (layers != "all" and not on_muon):
            raise ValueError(f"kfac_layers={layers!r}: one of {KFAC_LAYERS}, 'adamw-part' on Muon")
        self.precond: KFACPreconditioner | None = None
        if kfac:
            options = dict(keywords or {})
            if fraction is not None:
                options["factor_position_fraction"] = fraction
            if layers == "adamw-part":  # as the trainer builds it (kaisa_lab.cli.trainer)
                skips = adamw_part_skips(cast(MuonWithAdamW, self.opt).split.muon)
                options["skip_layers"] = [*options.get("skip_layers", ()), *skips]
            self.precond = KFACPreconditioner(self.model, optimizer=self.opt, **options)
        self.batches = batches
        self.index = 0
        self.clock: Callable[[], float] | None = None
        self.sync: Callable[[], None] | None = None
        self.muon: torch.optim.Optimizer | None = getattr(self.opt, "muon", None)
        self.reset()

    def time_parts(
        self, clock: Callable[[], float], sync: Callable[[], None] | None = None
    ) -> None:
        """From now on (counts reset) also time, per step, Muon's own step (its
        Newton–Schulz iterations) and K-FAC's decompositions and preconditioning
        products (a :class:`kaisa.step.profile.StepProfile`) on ``clock``
        (``time.process_time`` or ``time.perf_counter``), calling ``sync``
        before each reading (on a GPU; each reading then waits for the device,
        so a GPU step is timed on its own, without them)."""
        first = self.clock is None
        self.clock, self.sync = clock, sync
        if first and self.muon is not None:
            self.muon.register_step_pre_hook(lambda *_: self._muon_clock(start=True))
            self.muon.register_step_post_hook(lambda *_: self._muon_clock(start=False))
        self.reset()

    def reset(self) -> None:
        self.cpu_s = 0.0
        self.calls = 0
        self.step_ms: list[float] = []
        self.plain_ms: list[float] = []
        self.muon_s, self._muon_start = 0.0, 0.0
        if self.clock is not None and self.precond is not None:
            self.precond.profile = StepProfile(sync=self.sync, clock=self.clock)

    def _muon_clock(self, start: bool) -> None:
        assert self.clock is not None
        if self.sync is not None:
            self.sync()
        if start:
            self._muon_start = self.clock()
        else:
            self.muon_s += self.clock() - self._muon_start

    def parts_ms(self) -> dict[str, float]:
        """Per step since :meth:`reset` (ms): ``muon`` (torch's Muon step, for
        the matrices Muon takes), ``decompose`` and ``products`` (K-FAC's
        decompositions and preconditioning products); an arm without a part
        has none of it."""
        if self.clock is None:
            raise ValueError("its parts are not timed: call time_parts() first")
        calls = max(self.calls, 1)
        out = {"muon": 1e3 * self.muon_s / calls} if self.muon is not None else {}
        profile = self.precond.profile if self.precond is not None else None
        if profile is not None:
            for part, phase in (("decompose", DECOMPOSE), ("products", PRODUCTS)):
                out[part] = 1e3 * profile.seconds.get(phase, 0.0) / calls
        return out

    def ns_steps(self) -> int:
        """Muon's Newton–Schulz iterations a step (0 without Muon)."""
        return 0 if self.muon is None else int(self.muon.param_groups[0]["ns_steps"])

    def muon_shapes(self) -> list[tuple[int, int]]:
        """The shapes of the matrices Muon orthogonalises (none without Muon)."""
        if self.muon is None:
            return []
        return [(p.shape[0], p.shape[1]) for g in self.muon.param_groups for p in g["params"]]

    def __call__(self) -> None:
        cpu = time.process_time()
        x, y = self.batches[self.index % len(self.batches)]
        self.index += 1
        self.opt.zero_grad(set_to_none=True)
        self.task.loss(self.model(x), y).backward()
        if self.precond is not None:
            precond = self.precond
            k, config = precond.steps, precond.config
            plain = not (
                _updates(config.factor_update_steps, k) or _updates(config.inv_update_steps, k)
            )
            start = time.perf_counter()
            precond.step()
            ms = 1e3 * (time.perf_counter() - start)
            self.step_ms.append(ms)
            if plain:
                self.plain_ms.append(ms)
        self.opt.step()
        self.cpu_s += time.process_time() - cpu
        self.calls += 1

    def kfac_config(self) -> dict[str, Any] | None:
        """The preconditioner's configuration as built (what was timed), JSON-ready."""
        if self.precond is None:
            return None
        config = dataclasses.asdict(self.precond.config)
        out: dict[str, Any] = json.loads(json.dumps(config, default=str))
        return out


def floor_blocks(model: nn.Module) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(G⁻¹, A⁻¹, ∇)`` stand-ins for every layer K-FAC registers on ``model``,
    at the preconditioner's own factor sizes (Conv1d, attention's q/k/v rows
    and embeddings as well as Linear and Conv2d); a diagonal factor is a vector."""
    precond = KFACPreconditioner(model)
    blocks = []
    for layer in precond.layers.values():
        by_axis = {spec.axis: spec for spec in layer.factors}
        rows, cols = by_axis[0], by_axis[1]
        g_inv, a_inv = (
            torch.randn(spec.dim, spec.dim)
            if spec.kind is FactorKind.DENSE
            else torch.randn(spec.dim)
            for spec in (rows, cols)
        )
        blocks.append((g_inv, a_inv, torch.randn(rows.dim, cols.dim)))
    precond.remove_hooks()
    return blocks


def floor_kernels(blocks: Sequence[tuple[Tensor, Tensor, Tensor]]) -> Callable[[], None]:
    """One plain step's unavoidable products over ``blocks``: ``G⁻¹ ∇ A⁻¹`` and ``⟨V, ∇⟩``."""

    def run() -> None:
        for g_inv, a_inv, grad in blocks:
            v = g_inv @ grad if g_inv.dim() == 2 else grad * g_inv[:, None]
            v = v @ a_inv if a_inv.dim() == 2 else v * a_inv
            torch.vdot(v.reshape(-1), grad.reshape(-1))

    return run


def build_arm(
    task: Any, name: str, options: Mapping[str, Any], extra: Mapping[str, Any], batches: list[Any]
) -> tuple[TaskArm, dict[str, Any] | None]:
    """The arm ``name`` and, with ``options["case"]``, the lever it was built
    with (None without a case): an optimizer or ``opt+kfac`` (K-FAC as
    ``options["kfac"]`` says), or with a case one of that time-to-target
    case's K-FAC arm kinds (``muon+kfac-lean``): its lever's K-FAC keywords
    on top and its run fields a timed step carries (:attr:`TaskArm.LEVERS`)."""
    case_name = options.get("case")
    if not case_name or "+" not in name:  # an optimizer alone is the same in every case
        optimizer, kfac, _ = name.partition("+")
        keywords = kfac_keywords(task, optimizer, options["kfac"], extra) if kfac else None
        return TaskArm(task, name, keywords, batches), ({} if case_name else None)
    arm = case_arm(case_name, name)
    keywords = (
        {**kfac_keywords(task, arm.optimizer, options["kfac"], extra), **arm.kfac_lever()}
        if arm.kfac
        else None
    )
    base = f"{arm.optimizer}+kfac" if arm.kfac else arm.optimizer
    return TaskArm(task, base, keywords, batches, lever=arm.run_lever()), dict(arm.lever)


def case_arm(case_name: str, kind: str) -> Any:
    """The arm of time-to-target case ``case_name`` whose runs are called ``kind``
    (its K-FAC-tuned twin, which shares the kind, is not a step of its own)."""
    from kaisa_lab.bench.cases import get_case

    arms = [a for a in get_case(case_name).arms if not a.knobs]
    for arm in arms:
        if arm.kind == kind:
            return arm
    raise ValueError(
        f"arms: {kind!r} is not an arm of case {case_name!r}; choose from "
        f"{', '.join(a.kind for a in arms)}"
    )


def measure(options: Mapping[str, Any]) -> list[Row]:
    from kaisa_lab.tasks import get_task

    extra = parse_kfac_kwargs(options["kfac_kwargs"])
    rows = []
    for task_name in options["tasks"]:
        task = get_task(task_name)
        data = task.load()
        bs = task.defaults.batch_size
        order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))
        batches = task_batches(data, order, bs, (options["rounds"] + 1) * options["block"])
        names = options["arms"] or [task.defaults.optimizer, f"{task.defaults.optimizer}+kfac"]
        arms: dict[str, Callable[[], object]] = {}
        built: dict[str, TaskArm] = {}
        levers: dict[str, dict[str, Any] | None] = {}
        for name in names:
            built[name], levers[name] = build_arm(task, name, options, extra, batches)
            arms[name] = built[name]
        if options["floor"] and any(arm.precond is not None for arm in built.values()):
            torch.manual_seed(0)
            arms["floor"] = floor_kernels(floor_blocks(task.build_model()))
        for _ in range(options["block"]):  # a warm turn (lazy set-up, first decompositions)
            for step in arms.values():
                step()
        for each in built.values():
            each.reset()
        timed = interleave(arms, rounds=options["rounds"], block=options["block"], warmup=0)
        first = names[0]
        for position, (name, timing) in enumerate(timed.items()):
            config: dict[str, Any] = {"task": task_name, "arm": name, "batch": bs, "first": first}
            if levers.get(name) is not None:  # what the arm's lever set
                config["lever"] = levers[name]
            result: dict[str, Any] = {**timing.summary(), "position": position}
            arm = built.get(name)
            if arm is not None:
                config["kfac"] = arm.kfac_config()
                if arm.ns_steps():  # Muon's Newton–Schulz iterations, as stepped
                    config["muon_ns_steps"] = arm.ns_steps()
                result["cpu_ms"] = 1e3 * arm.cpu_s / max(1, arm.calls)
                if arm.precond is not None:
                    result["step_call_mean_ms"] = statistics.fmean(arm.step_ms)
                    result["step_call_plain_ms"] = (
                        statistics.median(arm.plain_ms) if arm.plain_ms else None
                    )
            rows.append(Row(f"{task_name} {name}", config, result))
    return rows


def _ordered(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Records in the order measured: the tasks as given, each task's arms as given."""
    tasks = list(records[0]["config"]["options"]["tasks"]) if records else []

    def key(r: Mapping[str, Any]) -> tuple[int, int]:
        task = r["config"]["task"]
        return tasks.index(task) if task in tasks else len(tasks), r["result"]["position"]

    return sorted(records, key=key)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def cost_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Per task and arm: wall and CPU ms per step (means) and both against the
    task's first arm; ``step()`` alone (mean, and on a plain step); the floor."""
    first: dict[str, Mapping[str, Any]] = {
        r["config"]["task"]: r["result"]
        for r in records
        if r["config"]["arm"] == r["config"]["first"]
    }
    lines = [
        "| task | arm | step, mean (ms) | step, median (ms) | vs first arm | CPU ms / step "
        "| vs first arm | `step()`, mean (ms) | `step()` on a plain step (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _ordered(records):
        c, res = r["config"], r["result"]
        base = first.get(c["task"], {})
        wall_vs = res["mean_ms"] / base["mean_ms"] if base.get("mean_ms") else None
        cpu = res.get("cpu_ms")
        cpu_vs = cpu / base["cpu_ms"] if cpu is not None and base.get("cpu_ms") else None
        arm = c["arm"] if c["arm"] != "floor" else "floor (`G⁻¹ ∇ A⁻¹`, `⟨V, ∇⟩` per layer)"
        lines.append(
            f"| {c['task']} ({c['batch']}) | {arm} | {res['mean_ms']:.2f} | "
            f"{res['median_ms']:.2f} | {_fmt(wall_vs)} | {_fmt(cpu)} | {_fmt(cpu_vs)} | "
            f"{_fmt(res.get('step_call_mean_ms'), 3)} | {_fmt(res.get('step_call_plain_ms'), 3)} |"
        )
    return "\n".join(lines) + "\n"


#: the K-FAC settings the ``kfac`` table shows
SHOWN = ("compute_method", "factor_update_steps", "inv_update_steps", "damping", "kl_clip")


def kfac_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Each K-FAC arm's settings as built (what was timed), and where the arms
    came from a time-to-target case, what each one's lever set."""
    levers = any("lever" in r["config"] for r in records)
    head = [*SHOWN, "lever"] if levers else list(SHOWN)
    lines = ["| task | arm | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
    for r in _ordered(records):
        config = r["config"].get("kfac")
        if config:
            cells = [str(config.get(k)) for k in SHOWN]
            if levers:
                lever = r["config"].get("lever") or {}
                cells.append(", ".join(f"`{k}={v}`" for k, v in lever.items()) or "-")
            lines.append(f"| {r['config']['task']} | {r['config']['arm']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Per task, each arm's mean step (ms), the floor among them."""
    _bars(records, path, "mean_ms", "ms per step (mean)")


def cpu_plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Per task, each arm's CPU time per step (ms), the first arm's as a line:
    the step's own cost, whatever else the machine ran."""
    _bars(records, path, "cpu_ms", "CPU ms per step (mean)", line=True)


def _bars(
    records: Sequence[Mapping[str, Any]], path: Path, key: str, label: str, line: bool = False
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = [r for r in _ordered(records) if r["result"].get(key) is not None]
    tasks = list(dict.fromkeys(r["config"]["task"] for r in ordered))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        mine = [r for r in ordered if r["config"]["task"] == task]
        ax.bar(range(len(mine)), [r["result"][key] for r in mine])
        ax.set_xticks(range(len(mine)), [r["config"]["arm"] for r in mine], rotation=35, ha="right")
        if line:
            ax.axhline(mine[0]["result"][key], color="k", lw=0.8, ls="--")
        ax.set_title(task)
        ax.set_ylabel(label)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="task-step-cost",
        description="each arm's step (optimizer ± K-FAC) on a task's own model and batches, "
        "interleaved, with step() alone and the floor of its products",
        measure=measure,
        options={
            "tasks": ["digits-mlp", "digits-cnn", "digits-ae"],
            "arms": None,  # the task's optimizer, then it + kfac
            "kfac": "task",
            "kfac_kwargs": {},
            "rounds": 10,
            "block": 10,
            "floor": True,
        },
        quick={"tasks": ["digits-mlp"], "rounds": 2, "block": 2},
        tables={"cost": cost_table, "kfac": kfac_table},
        plot=plot,
    )
)


#: the levers cases' step-cost arms: Muon and AdamW alone, with K-FAC at the
#: library's defaults, with each step-cost lever the cases run (an eighth of
#: the positions; with block-diagonal factors and bfloat16 Grams; Muon's
#: Newton–Schulz iterations cut to 3) and with all of them (the leanest step)
LEVER_STEP_ARMS = [
    "muon",
    "muon+kfac",
    "muon+kfac-pos0.125",
    "muon+kfac-block129-pos0.125-bf16",
    "muon+kfac-ns3",
    "muon+kfac-lean",
    "muon+kfac-adamw-part",
    "adamw",
    "adamw+kfac",
    "adamw+kfac-lean",
]

LEVERS_CASE = register(
    TimingCase(
        name="levers-step-cost",
        description="the step of the levers cases' arms (Muon and AdamW, ± K-FAC at the "
        "library's defaults, ± its step-cost levers) on text-lm's and text-cnn's models, "
        "interleaved, factor steps and decompositions amortised, on the CPU clock",
        measure=measure,
        options={
            "tasks": ["text-lm", "text-cnn"],
            "case": "text-lm-levers",  # the arms declared (text-cnn-levers: a subset)
            "arms": LEVER_STEP_ARMS,
            "kfac": "defaults",
            "kfac_kwargs": {},
            "rounds": 30,  # 30 turns: a lever of a few percent stands above the turns' spread
            "block": 10,
            "floor": False,
        },
        quick={"tasks": ["text-lm"], "arms": ["muon", "muon+kfac-lean"], "rounds": 1, "block": 2},
        tables={"cost": cost_table, "kfac": kfac_table},
        plot=cpu_plot,
    )
)
