"""The cost of a K-FAC step relative to a plain SGD step, on one process.

The models and settings of the field notes (where kfac-pytorch 0.4.2
measured 7.2× and 3.9× a plain SGD step): the 784-512-512-10 MLP and the
small CNN of :mod:`kaisa_lab.bench.costs.models`, batch 128, SGD with
momentum, and K-FAC variants beside the plain step:

- ``kfac eigen f=1 inv=10``: factors every step, inverses every 10 (eigen);
- ``kfac eigen f=10 inv=100``: factors every 10 steps, inverses every 100;
- ``kfac inverse f=1 inv=10``: the inverse method at 1/10;
- ``kfac eigen f=10 inv=100 replayed`` (CUDA only): ``precond.compile(mode=
  "reduce-overhead")``, non-factor steps replayed as a CUDA graph;
- ``kfac eigen f=10 inv=100 read`` (CUDA only): ``precond.read_scalars =
  True``, every step's verdict read on the host (what an exact skip of a
  non-finite step costs an unfused optimizer: no replay, one read per step);
- ``sgd fused`` and ``kfac eigen f=10 inv=100 fused replayed`` (CUDA only):
  torch's fused SGD, which takes kaisa's verdict on the device and skips a
  non-finite step there, replayed.

Every arm of a model (variant × library) is timed in turns
(:func:`~kaisa_lab.bench.timer.interleave`: ``block`` steps of each arm,
``rounds`` times, after ``block`` + 1 untimed steps), so a change of load
falls on every arm alike. A record keeps each arm's per-step median and mean
(the mean amortises the factor and inverse steps that fall among the
``rounds × block`` timed ones — at the defaults, six inverse updates of the
``inv=10`` variants and none of ``inv=100`` — the median is a step without an
inverse update) and the minor page faults per step (on CPU, freed
temporaries that the C allocator gave back are faulted in again:
:func:`kaisa.tune_cpu_allocator`, on unless ``allocator`` is ``"default"``).

With ``reference_src`` (a kfac-pytorch source tree, imported from there and
never copied; default: ``shared/kfac-pytorch`` beside this repository where
it exists, or ``$KAISA_KFAC_PYTORCH``) every K-FAC variant but the replayed
one is also timed with kfac-pytorch's ``KFACPreconditioner`` under the same
keywords, in the same turns. Its G is not rescaled for the mean loss and its
factors start at the identity, so the two do not compute the same update;
the comparison is of cost.

Batches are drawn in turn from a pool of 8: a step repeated on one fixed
batch drives the gradients into subnormal floats, which make CPU matrix
products 10–20× slower and would inflate every K-FAC row.

    kaisa bench run step-cost
    kaisa bench run step-cost --device cuda --option device=cuda
    kaisa bench ab step-cost --before HEAD~1 --quick     # a change, before and after
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kaisa import KFACPreconditioner, tune_cpu_allocator
from kaisa_lab.bench.costs.models import STEP_MODELS
from kaisa_lab.bench.timer import interleave
from kaisa_lab.bench.timing import Row, TimingCase, register

__all__ = [
    "CUDA_ONLY",
    "REPLAYED",
    "VARIANTS",
    "StepArm",
    "default_reference_src",
    "minor_faults",
    "reference_preconditioner",
]

#: K-FAC's keywords per variant (None: plain SGD); eigen pinned where named
VARIANTS: dict[str, dict[str, Any] | None] = {
    "sgd": None,
    "kfac eigen f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="eigen"
    ),
    "kfac eigen f=10 inv=100": dict(
        factor_update_steps=10, inv_update_steps=100, compute_method="eigen"
    ),
    "kfac inverse f=1 inv=10": dict(
        factor_update_steps=1, inv_update_steps=10, compute_method="inverse"
    ),
    "kfac eigen f=10 inv=100 replayed": dict(
        factor_update_steps=10, inv_update_steps=100, compute_method="eigen"
    ),
    # what a NaN step's exact skip costs on an accelerator: the verdict read
    # every step (no replay then), against a fused SGD that skips on the device
    "kfac eigen f=10 inv=100 read": dict(
        factor_update_steps=10, inv_update_steps=100, compute_method="eigen"
    ),
    "sgd fused": None,
    "kfac eigen f=10 inv=100 fused replayed": dict(
        factor_update_steps=10, inv_update_steps=100, compute_method="eigen"
    ),
}
#: variants timed with ``precond.compile(mode="reduce-overhead")`` (kaisa, CUDA only)
REPLAYED = frozenset({"kfac eigen f=10 inv=100 replayed", "kfac eigen f=10 inv=100 fused replayed"})
#: variants whose preconditioner reads every step's scalars (``read_scalars=True``)
READ = frozenset({"kfac eigen f=10 inv=100 read"})
#: variants whose SGD is torch's fused one (it takes kaisa's verdict on the device)
FUSED = frozenset({"sgd fused", "kfac eigen f=10 inv=100 fused replayed"})
#: variants that only mean something on an accelerator (kaisa's, CUDA only)
CUDA_ONLY = REPLAYED | READ | FUSED
#: distinct batches cycled through (no subnormal drift, no data loading cost)
POOL = 8
#: the repository this module lives in
_ROOT = Path(__file__).resolve().parents[5]

Preconditioner = Callable[..., Any]


def default_reference_src() -> str | None:
    """kfac-pytorch's source: ``$KAISA_KFAC_PYTORCH``, else the nearest
    ``shared/kfac-pytorch`` above this repository; None where there is none."""
    given = os.environ.get("KAISA_KFAC_PYTORCH")
    candidates = [Path(given)] if given else [p / "shared" / "kfac-pytorch" for p in _ROOT.parents]
    for candidate in candidates:
        if (candidate / "kfac").is_dir():
            return str(candidate)
    return None


def reference_preconditioner(src: Path | str) -> Preconditioner:
    """kfac-pytorch's ``KFACPreconditioner``, imported from the source tree ``src``.

    A source tree that was never pip-installed has no package metadata, which
    its ``kfac/__init__.py`` reads for ``__version__``; then the package is
    entered without running that file (its submodules import as usual)."""
    src = Path(src)
    if not (src / "kfac").is_dir():
        raise ValueError(f"reference_src {src}: no kfac package in it")
    # the process's own kfac (if any) and path come back afterwards: the class keeps
    # what it needs, and nothing else in this process sees the entered package
    path, modules = list(sys.path), {n: m for n, m in sys.modules.items() if _is_kfac(n)}
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    try:
        try:
            module = importlib.import_module("kfac.preconditioner")
        except importlib.metadata.PackageNotFoundError:
            for name in [n for n in sys.modules if _is_kfac(n)]:
                del sys.modules[name]
            package = importlib.util.module_from_spec(
                importlib.machinery.ModuleSpec("kfac", None, is_package=True)
            )
            package.__path__ = [str(src / "kfac")]
            sys.modules["kfac"] = package
            module = importlib.import_module("kfac.preconditioner")
        return module.KFACPreconditioner
    finally:
        for name in [n for n in sys.modules if _is_kfac(n)]:
            del sys.modules[name]
        sys.modules.update(modules)
        sys.path[:] = path


def _is_kfac(name: str) -> bool:
    return name == "kfac" or name.startswith("kfac.")


def minor_faults() -> int:
    """Pages this process has faulted in so far (0 where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class StepArm:
    """One model with SGD and, for a K-FAC variant, a preconditioner: a training
    step per call, on the next batch of a pool of :data:`POOL`."""

    def __init__(
        self,
        model_name: str,
        kfac: Mapping[str, Any] | None,
        batch: int,
        device: str = "cpu",
        preconditioner: Preconditioner | None = None,
        replayed: bool = False,
        read: bool = False,
        fused: bool = False,
    ) -> None:
        torch.manual_seed(0)
        self.model = STEP_MODELS[model_name]().to(device)
        self.opt = torch.optim.SGD(
            self.model.parameters(), lr=0.01, momentum=0.9, fused=fused or None
        )
        self.precond: Any = None
        if kfac is not None:
            if preconditioner is None:  # kaisa reads the learning rate from the optimizer
                self.precond = KFACPreconditioner(self.model, optimizer=self.opt, **kfac)
            else:  # kfac-pytorch takes it as ``lr``
                self.precond = preconditioner(self.model, lr=0.01, **kfac)
            if replayed:
                self.precond.compile(mode="reduce-overhead")
            if read:
                self.precond.read_scalars = True
        self.xs = torch.randn(POOL, batch, 1, 28, 28, device=device)
        self.ys = torch.randint(0, 10, (POOL, batch), device=device)
        self.index = 0
        self.faults = 0
        self.counted = 0

    def __call__(self) -> None:
        before = minor_faults()
        i = self.index % POOL
        self.index += 1
        self.opt.zero_grad()
        F.cross_entropy(self.model(self.xs[i]), self.ys[i]).backward()
        if self.precond is not None:
            self.precond.step()
        self.opt.step()
        self.faults += minor_faults() - before
        self.counted += 1

    def reset_counts(self) -> None:
        self.faults = self.counted = 0

    @property
    def faults_per_step(self) -> float:
        return self.faults / self.counted if self.counted else 0.0


def _variants(options: Mapping[str, Any]) -> list[str]:
    chosen = options["variants"]
    cuda = str(options["device"]).startswith("cuda")
    if chosen is None:
        return [v for v in VARIANTS if cuda or v not in CUDA_ONLY]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise ValueError(f"step-cost: unknown variants {unknown}; known: {list(VARIANTS)}")
    if not cuda and any(v in CUDA_ONLY for v in chosen):
        raise ValueError(
            f"step-cost: the variants {sorted(CUDA_ONLY)} need device=cuda (CUDA graphs, "
            "a verdict kept on the device)"
        )
    return list(chosen)


def measure(options: Mapping[str, Any]) -> list[Row]:
    device = str(options["device"])
    unknown = [m for m in options["models"] if m not in STEP_MODELS]
    if unknown:
        raise ValueError(f"step-cost: unknown models {unknown}; known: {list(STEP_MODELS)}")
    variants = _variants(options)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("step-cost: device=cuda, but torch sees no GPU")
    tuned = options["allocator"] != "default" and tune_cpu_allocator()
    libraries: dict[str, Preconditioner | None] = {"kaisa": None}
    if options["reference_src"]:
        libraries["kfac-pytorch"] = reference_preconditioner(options["reference_src"])
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    rows = []
    for model_name in options["models"]:
        arms: dict[str, StepArm] = {}
        described: dict[str, dict[str, Any]] = {}
        for variant in variants:
            kfac = VARIANTS[variant]
            for library, preconditioner in libraries.items():
                if library != "kaisa" and (kfac is None or variant in CUDA_ONLY):
                    continue  # one SGD arm; replay and the device verdict are kaisa's
                name = model_name + " " + variant + ("" if library == "kaisa" else f" ({library})")
                try:
                    arm = StepArm(
                        model_name, kfac, options["batch"], device, preconditioner,
                        replayed=variant in REPLAYED, read=variant in READ,
                        fused=variant in FUSED,
                    )  # fmt: skip
                    arm()  # a library that cannot step this model fails here, not mid-turn
                except Exception as exc:
                    if library == "kaisa":
                        raise
                    print(f"step-cost: {name} left out: {library} failed: {exc}", file=sys.stderr)
                    continue
                arms[name] = arm
                described[name] = {
                    "model": model_name,
                    "variant": variant,
                    "library": library if kfac is not None else "torch",
                    "kfac": kfac,
                }
        for _ in range(options["block"]):  # a warm turn, its faults not counted
            for arm in arms.values():
                arm()
        for arm in arms.values():
            arm.reset_counts()
        timed = interleave(
            dict(arms), rounds=options["rounds"], block=options["block"], warmup=0, sync=sync
        )
        for name, timing in timed.items():
            config = {
                **described[name],
                "batch": options["batch"],
                "device": device,
                "allocator": "glibc, thresholds raised" if tuned else "default",
            }
            result = {**timing.summary(), "page_faults_per_step": arms[name].faults_per_step}
            rows.append(Row(name, config, result))
    return rows


def _ordered(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Records in the order of :data:`STEP_MODELS` and :data:`VARIANTS`, kaisa first."""
    models, variants = list(STEP_MODELS), list(VARIANTS)

    def key(r: Mapping[str, Any]) -> tuple[int, int, bool]:
        c = r["config"]
        where = models.index(c["model"]) if c["model"] in models else len(models)
        return where, variants.index(c["variant"]), c["library"] == "kfac-pytorch"

    return sorted(records, key=key)


def _sgd_means(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    return {
        r["config"]["model"]: r["result"]["mean_ms"]
        for r in records
        if r["config"]["variant"] == "sgd"
    }


def ratio_table(records: Sequence[Mapping[str, Any]]) -> str:
    """Per model and variant: the step's mean and median (ms), the mean over SGD's
    mean, and the page faults per step."""
    sgd = _sgd_means(records)
    lines = [
        "| model | variant | library | step, mean (ms) | step, median (ms) | × SGD "
        "| page faults / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in _ordered(records):
        c, res = r["config"], r["result"]
        base = sgd.get(c["model"])
        ratio = "-" if not base else f"{res['mean_ms'] / base:.2f}"
        lines.append(
            f"| {c['model']} | {c['variant']} | {c['library']} | {res['mean_ms']:.2f} | "
            f"{res['median_ms']:.2f} | {ratio} | {res['page_faults_per_step']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def reference_table(records: Sequence[Mapping[str, Any]]) -> str:
    """kaisa beside kfac-pytorch, per model and K-FAC variant (mean ms per step)."""
    by: dict[tuple[str, str], dict[str, float]] = {}
    for r in _ordered(records):
        c = r["config"]
        by.setdefault((c["model"], c["variant"]), {})[c["library"]] = r["result"]["mean_ms"]
    sgd = _sgd_means(records)
    lines = [
        "| model | variant | kaisa (ms) | kfac-pytorch (ms) | kaisa / kfac-pytorch |",
        "|---|---|---|---|---|",
    ]
    for (model, variant), libs in by.items():
        if "kfac-pytorch" not in libs or "kaisa" not in libs:
            continue
        label = model if model not in sgd else f"{model} (SGD {sgd[model]:.2f} ms)"
        ours, theirs = libs["kaisa"], libs["kfac-pytorch"]
        lines.append(f"| {label} | {variant} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |")
    if len(lines) == 2:
        return "no kfac-pytorch arm in this measurement (option reference_src)\n"
    return "\n".join(lines) + "\n"


def plot(records: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Each arm's mean step over its model's SGD step (horizontal bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sgd = _sgd_means(records)
    shown = [r for r in _ordered(records) if sgd.get(r["config"]["model"])]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * max(1, len(shown))))
    labels = [f"{r['config']['model']} {r['config']['variant']} ({r['config']['library']})"
              for r in shown]  # fmt: skip
    ax.barh(range(len(shown)), [r["result"]["mean_ms"] / sgd[r["config"]["model"]]
                                for r in shown])  # fmt: skip
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.set_xlabel("step time / SGD step time (means)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CASE = register(
    TimingCase(
        name="step-cost",
        description="a K-FAC step against a plain SGD step (MLP, CNN; batch 128), variants "
        "interleaved, kfac-pytorch beside kaisa where its source is found",
        measure=measure,
        options={
            "models": list(STEP_MODELS),
            "variants": None,  # all; the replayed one on CUDA only
            "rounds": 6,
            "block": 10,
            "batch": 128,
            "reference_src": default_reference_src(),
            "allocator": "tuned",
            "device": "cpu",
        },
        quick={
            "models": ["mlp-784-512-512-10"],
            "variants": ["sgd", "kfac inverse f=1 inv=10"],
            "rounds": 2,
            "block": 2,
            "batch": 16,
        },
        tables={"ratio": ratio_table, "reference": reference_table},
        plot=plot,
        device="any",
    )
)
