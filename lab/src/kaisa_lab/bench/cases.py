"""The suite's time-to-target cases, declared as data: task × arms × protocol × budget.

A case is one comparison a report answers: every arm of it is tuned by the
same :class:`~kaisa_lab.bench.protocol.Protocol` on the same task, from the
same initial weights and batches, and held out on the same seeds. The
arms:

- **first-order**: the optimizer alone, as its library documents it;
- **K-FAC at the library's defaults** (``<optimizer>+kfac``): kaisa's
  defaults, only the base optimizer's lr and warm-up tuned;
- **K-FAC tuned** (``<optimizer>+kfac tuned``): the same grid, with the
  follow-ups of its budget spent on K-FAC's own knobs (:data:`KFAC_KNOBS`)
  instead of the lr.

Both K-FAC arms train the same runs on their grid (the settings are equal),
so a record serves both. The budget (epochs, steps per epoch, evaluations)
and schedule shape are the task's; the warm-up axis is none and the task's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kaisa.config import KFACConfig
from kaisa_lab.bench.protocol import Protocol, Setting, grid
from kaisa_lab.cli.spec import RunSpec
from kaisa_lab.optim import BASELINE_LR, KFAC_BASES
from kaisa_lab.tasks.registry import get_task

__all__ = [
    "CASES",
    "KFAC_KNOBS",
    "KFAC_LEVER",
    "LARGE_BATCH_KNOBS",
    "LEVER_FIELDS",
    "LOST_ON_TEXT_LM",
    "Arm",
    "TrainCase",
    "get_case",
    "lever_cases",
    "summary_cases",
]

#: the run fields an arm's lever may set (:mod:`kaisa_lab.levers`); a K-FAC
#: keyword is set as ``"kfac.<keyword>"`` (``("kfac.kl_clip", 0.1)``)
LEVER_FIELDS = ("eigen_power", "fisher", "muon_ns_steps", "position_fraction", "kfac_layers")
KFAC_LEVER = "kfac."

#: what a tuned K-FAC arm's follow-ups try at its best lr and warm-up, in order:
#: curvature refreshed twice as often, and a third of the default damping
KFAC_KNOBS: tuple[Mapping[str, Any], ...] = ({"inv_update_steps": 50}, {"damping": 0.1})


@dataclass(frozen=True)
class Arm:
    """One row of a comparison: an optimizer, with or without K-FAC, and its knobs."""

    optimizer: str
    kfac: bool = False
    #: K-FAC variants its follow-ups may try (empty: lr and warm-up only)
    knobs: tuple[Mapping[str, Any], ...] = ()
    #: a lever under measurement (:mod:`kaisa_lab.levers`): run fields it sets,
    #: and the short tag its runs' name carries
    lever: tuple[tuple[str, Any], ...] = ()
    tag: str = ""

    def __post_init__(self) -> None:
        if self.knobs and not self.kfac:
            raise ValueError(f"{self.optimizer}: knobs are K-FAC's; this arm has no K-FAC")
        if self.kfac and self.optimizer not in KFAC_BASES:
            raise ValueError(f"K-FAC does not run on {self.optimizer}")
        keywords = KFACConfig.field_names()
        unknown = {
            k
            for k, _ in self.lever
            if k not in LEVER_FIELDS
            and not (k.startswith(KFAC_LEVER) and k.removeprefix(KFAC_LEVER) in keywords)
        }
        if unknown:
            raise ValueError(
                f"unknown lever field(s) {sorted(unknown)}; choose from {LEVER_FIELDS} or "
                f"'{KFAC_LEVER}<a K-FAC keyword>'"
            )
        if any(k.startswith(KFAC_LEVER) for k, _ in self.lever) and not self.kfac:
            raise ValueError(f"{self.optimizer}: a K-FAC keyword lever needs K-FAC")
        if bool(self.lever) != bool(self.tag):
            raise ValueError("an arm with a lever names it by a tag, and only such an arm")

    def kfac_lever(self) -> dict[str, Any]:
        """The K-FAC keywords its lever sets."""
        return {k.removeprefix(KFAC_LEVER): v for k, v in self.lever if k.startswith(KFAC_LEVER)}

    def run_lever(self) -> dict[str, Any]:
        """The run fields its lever sets."""
        return {k: v for k, v in self.lever if not k.startswith(KFAC_LEVER)}

    @property
    def kind(self) -> str:
        """What its runs are called (their records' folder): shared by both K-FAC arms."""
        base = f"{self.optimizer}+kfac" if self.kfac else self.optimizer
        return f"{base}-{self.tag}" if self.tag else base

    @property
    def name(self) -> str:
        return f"{self.kind} tuned" if self.knobs else self.kind


@dataclass(frozen=True)
class TrainCase:
    """A time-to-target comparison on one task."""

    name: str
    task: str
    arms: tuple[Arm, ...]
    #: the warm-up axis (epochs): none, and the task's
    warmups: tuple[float, ...]
    protocol: Protocol = field(default_factory=Protocol)
    #: overrides of the task's budget (None: the task's)
    epochs: int | None = None
    steps_per_epoch: int | None = None
    evals_per_epoch: int | None = None
    batch_size: int | None = None
    #: whether ``make bench`` runs it
    quick: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        names = [arm.name for arm in self.arms]
        if len(set(names)) != len(names):
            raise ValueError(f"case {self.name}: an arm is named twice in {names}")

    @property
    def schedule(self) -> str:
        return get_task(self.task).defaults.schedule

    @property
    def global_batch(self) -> int:
        """The batch a step reads: the case's, else its task's."""
        return self.batch_size or get_task(self.task).defaults.batch_size

    def prior_lr(self, optimizer: str) -> float:
        """The centre of an arm's lr grid: the task's lr for it, else its library's."""
        lrs = get_task(self.task).defaults.lr
        return float(lrs[optimizer] if optimizer in lrs else BASELINE_LR[optimizer])

    def grid(self, arm: Arm) -> list[Setting]:
        return grid(self.protocol, self.prior_lr(arm.optimizer), self.warmups, self.schedule)

    def arm(self, name: str) -> Arm:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(f"case {self.name} has no arm {name!r}; arms: {[a.name for a in self.arms]}")

    def spec(self, arm: Arm, setting: Setting, seed: int) -> RunSpec:
        """The run of ``arm`` at ``setting`` on ``seed``: the task's budget, stopped at target."""
        task = get_task(self.task)
        d = task.defaults
        muon = arm.optimizer == "muon"
        steps = self.steps_per_epoch or d.steps_per_epoch
        spec = RunSpec(
            name=arm.kind,
            task=task.name,
            optimizer=arm.optimizer,
            kfac=arm.kfac,
            epochs=self.epochs or d.epochs,
            batch_size=self.batch_size or d.batch_size,
            lr=setting.lr,
            momentum=d.momentum,
            weight_decay=d.decay(arm.optimizer),
            seed=seed,
            target=task.target,
            steps_per_epoch=steps,
            eval_batch_size=d.eval_batch_size,
            stop_at_target=True,
            evals_per_epoch=self.evals_per_epoch or d.evals_per_epoch,
            schedule=setting.schedule,
            warmup_epochs=setting.warmup_epochs,
            kfac_kwargs=(
                {"loss_average": task.loss_average, **dict(setting.kfac), **arm.kfac_lever()}
                if arm.kfac
                else {}
            ),
            lr_tuned=True,
            adamw_lr=d.base_lr("adamw") if muon else None,
            adamw_weight_decay=d.decay("adamw") if muon else None,
        )
        return dataclasses.replace(spec, **arm.run_lever())


def _arms(
    optimizers: tuple[str, ...], kfac_on: tuple[str, ...], tuned: tuple[str, ...]
) -> tuple[Arm, ...]:
    return (
        *(Arm(o) for o in optimizers),
        *(Arm(o, kfac=True) for o in kfac_on),
        *(Arm(o, kfac=True, knobs=KFAC_KNOBS) for o in tuned),
    )


#: the language-model families: every baseline, K-FAC at defaults on every base, tuned on two
_LM_ARMS = _arms(
    ("sgd", "adamw", "muon", "soap", "shampoo", "lamb"),
    ("sgd", "adamw", "muon", "lamb"),
    ("adamw", "muon"),
)
#: the small families: SGD and AdamW, with and without K-FAC
_SMALL_ARMS = _arms(("sgd", "adamw"), ("sgd", "adamw"), ("sgd", "adamw"))

#: the large-batch study (text-lm at more rows a step, as data-parallel jobs
#: grow the global batch with the ranks): the peers a user would pick, K-FAC
#: on each at its defaults, and on Muon with its curvature refreshed more
#: often (a short large-batch run sees few inverse updates at the defaults)
LARGE_BATCH_KNOBS: tuple[Mapping[str, Any], ...] = (
    {"inv_update_steps": 10},
    {"factor_update_steps": 1, "inv_update_steps": 10},
)
_LARGE_BATCH_ARMS = (
    *_arms(("adamw", "muon"), ("adamw", "muon"), ()),
    Arm("muon", kfac=True, knobs=LARGE_BATCH_KNOBS),
)
#: the cheaper-Gram levers together (:data:`_LEVER_ARMS`), where a factor
#: step's Grams weigh most: at batch 512 they read 65,536 positions a step
_GRAM_LEVERS = Arm(
    "muon",
    kfac=True,
    lever=(("position_fraction", 0.125), ("kfac.factor_compute_dtype", "bfloat16")),
    tag="pos0.125-bf16",
)


def _blocks(dim: int) -> tuple[tuple[str, Any], ...]:
    """Every factor above ``dim`` rows kept block-diagonal in blocks of at most
    ``dim`` (a layers' width plus the bias): a factor four times as wide has
    products a quarter of the dense ones' (a library option, used for speed)."""
    return (("kfac.max_factor_dim", dim), ("kfac.large_factor", "block"))


_BLOCKS = _blocks(129)  # text-lm's layers are 128 wide


def _lean(optimizer: str, positions: bool = True) -> Arm:
    """K-FAC on ``optimizer`` with every step-cost lever: block-diagonal
    factors, an eighth of the positions (unless not ``positions``: every
    position read, tag ``lean-allpos``), bfloat16 Grams and preconditioning
    products, and on Muon 3 Newton–Schulz iterations."""
    lever = (
        *_BLOCKS,
        *(_GRAM_LEVERS.lever if positions else (("kfac.factor_compute_dtype", "bfloat16"),)),
        ("kfac.precondition_dtype", "bfloat16"),
        *((("muon_ns_steps", 3),) if optimizer == "muon" else ()),
    )
    return Arm(optimizer, kfac=True, lever=lever, tag="lean" if positions else "lean-allpos")


#: K-FAC under Muon on the layers Muon hands to AdamW only (the embeddings and
#: the head): on text-lm's grid it needs the steps of K-FAC on every layer at
#: a step that costs about Muon's (levers-step-cost)
_ADAMW_PART = Arm("muon", kfac=True, lever=(("kfac_layers", "adamw-part"),), tag="adamw-part")

#: the levers on text-lm (each K-FAC arm at the defaults beside its lever):
#: fewer Newton–Schulz iterations under K-FAC, a partial inverse power, the
#: Monte Carlo Fisher on each base, factor statistics from an eighth of the
#: positions or from each sequence's sum (K-FAC-reduce), K-FAC on Muon's
#: AdamW part only, SGD's KL clip loosened (kfac-pytorch's 0.001 caps SGD +
#: K-FAC's steps), the factors' step-cost levers together, and those with
#: bfloat16 products on Muon (and 3 Newton–Schulz iterations) and on AdamW
_LEVER_ARMS = (
    *_arms(("muon",), ("muon", "adamw", "sgd"), ()),
    Arm("muon", kfac=True, lever=(("muon_ns_steps", 3),), tag="ns3"),
    Arm("muon", kfac=True, lever=(("eigen_power", 0.5),), tag="p0.5"),
    Arm("adamw", kfac=True, lever=(("eigen_power", 0.5),), tag="p0.5"),
    Arm("muon", kfac=True, lever=(("fisher", "mc"),), tag="mc"),
    Arm("adamw", kfac=True, lever=(("fisher", "mc"),), tag="mc"),
    Arm("sgd", kfac=True, lever=(("fisher", "mc"),), tag="mc"),
    Arm("muon", kfac=True, lever=(("position_fraction", 0.125),), tag="pos0.125"),
    Arm("muon", kfac=True, lever=(("kfac.kfac_approx", "reduce"),), tag="reduce"),
    _ADAMW_PART,
    Arm("sgd", kfac=True, lever=(("kfac.kl_clip", 0.1),), tag="clip0.1"),
    # the factors' step-cost levers together (block-diagonal factors, an eighth
    # of the positions, bfloat16 Grams): bfloat16 Grams and blocks alone change
    # the step's cost, which levers-step-cost times, far more than its steps,
    # so they run for steps only together (the positions alone are above)
    Arm("muon", kfac=True, lever=(*_BLOCKS, *_GRAM_LEVERS.lever), tag="block129-pos0.125-bf16"),
    # the leanest step: the three above and the preconditioning products in
    # bfloat16 too; on Muon (which orthogonalises in bfloat16 anyway) its
    # Newton–Schulz iterations cut to 3 as well (K-FAC has whitened the direction)
    _lean("muon"),
    _lean("adamw"),
)

#: the levers tried cheaply first: those that lost on text-lm's held-out
#: seeds (time to target over K-FAC's at the defaults on the same base,
#: paired by seed: the levers table's verdict) — the partial power and the
#: Monte Carlo Fisher on every base, K-FAC-reduce, the looser KL clip. A
#: lever becomes a default only if it wins on every family, so text-cnn does
#: not run them, nor SGD + K-FAC, then no lever's base; the levers page gives
#: what each bought on text-lm. A test derives this set again from the
#: committed records
LOST_ON_TEXT_LM = frozenset(
    {
        "muon+kfac-p0.5",
        "adamw+kfac-p0.5",
        "muon+kfac-mc",
        "adamw+kfac-mc",
        "muon+kfac-reduce",
        "sgd+kfac-clip0.1",
        "sgd+kfac-mc",
        "sgd+kfac",
    }
)
_CNN_LEVER_ARMS = tuple(a for a in _LEVER_ARMS if a.name not in LOST_ON_TEXT_LM)

#: at batch 512, the leanest step on Muon but every position read (an
#: eighth of them cost steps there): what a data-parallel rank's step costs
#: when each rank holds a few rows, where the preconditioning products and
#: Muon's iterations, paid every step whatever the batch, weigh most
_LEAN_ALL_POSITIONS = _lean("muon", positions=False)
#: at batch 512, the step cut where it leaves K-FAC's direction whole: the
#: preconditioning products in bfloat16 and Muon's Newton–Schulz iterations
#: at 3 (Muon orthogonalises in bfloat16 anyway), the factors dense and read
#: from every position in float32 (the levers lean-allpos adds, blocks and
#: bfloat16 Grams, change the curvature itself)
_NS3_BF16_PRODUCTS = Arm(
    "muon",
    kfac=True,
    lever=(("kfac.precondition_dtype", "bfloat16"), ("muon_ns_steps", 3)),
    tag="ns3-bf16prod",
)

#: text-lm-large: every baseline; K-FAC on the bases language models train
#: with (AdamW and Muon), at its defaults and tuned (on SGD and LAMB, text-lm
#: and text-cnn measure it); on Muon + K-FAC every step-cost lever at once
#: (blocks of at most 257: its layers' width plus the bias), and K-FAC on
#: Muon's AdamW part only.  Its runs are the suite's longest (a 4-block,
#: 256-wide model for up to 1,000 steps), so it holds no arm the cheaper
#: families answer for it
_LARGE_ARMS = (
    *_arms(
        ("sgd", "adamw", "muon", "soap", "shampoo", "lamb"), ("adamw", "muon"), ("adamw", "muon")
    ),
    Arm(
        "muon",
        kfac=True,
        lever=(*_blocks(257), *_GRAM_LEVERS.lever),
        tag="block257-pos0.125-bf16",
    ),
    _ADAMW_PART,
)

CASES: dict[str, TrainCase] = {
    case.name: case
    for case in (
        TrainCase(
            "digits-mlp",
            "digits-mlp",
            _SMALL_ARMS,
            warmups=(0.0, 1.0),
            evals_per_epoch=23,  # after every step: steps to target not rounded to an epoch
            description="3-layer MLP on the digits images (batch 64), to 95% test accuracy",
        ),
        TrainCase(
            "digits-cnn",
            "digits-cnn",
            _SMALL_ARMS,
            warmups=(0.0, 0.5),
            description="small CNN on the digits images (batch 64), to 97% test accuracy",
        ),
        TrainCase(
            "digits-ae",
            "digits-ae",
            _SMALL_ARMS,
            warmups=(0.0, 1.0),
            description="deep autoencoder of the digits images (batch 64), to 0.12 test loss",
        ),
        TrainCase(
            "text-lm",
            "text-lm",
            _LM_ARMS,
            warmups=(0.0, 0.25),
            description="2-block, 128-wide character Transformer (batch 32), to 2.5 bits/char",
        ),
        TrainCase(
            "text-cnn",
            "text-cnn",
            _LM_ARMS,
            warmups=(0.0, 0.25),
            description="causal dilated convolutional character LM (batch 32), to 2.5 bits/char",
        ),
        TrainCase(
            "text-lm-large",
            "text-lm-large",
            _LARGE_ARMS,
            warmups=(0.0, 0.25),
            description="4-block, 256-wide character Transformer (batch 32), to 2.03 bits/char",
        ),
        # the large-batch study: batch 32 is the text-lm case; a larger batch
        # needs fewer steps, so a shorter budget, read more often (every 10
        # and 5 steps, text-lm's every 20) to keep the steps' resolution
        *(
            TrainCase(
                f"text-lm-b{batch}",
                "text-lm",
                arms,
                warmups=(0.0, 0.25),
                epochs=epochs,
                evals_per_epoch=evals,
                batch_size=batch,
                description=f"text-lm at batch {batch} (the large-batch study), to 2.5 bits/char",
            )
            for batch, epochs, evals, arms in (
                (128, 3, 20, _LARGE_BATCH_ARMS),
                (
                    512,
                    2,
                    40,
                    (
                        *_LARGE_BATCH_ARMS,
                        _GRAM_LEVERS,
                        _LEAN_ALL_POSITIONS,
                        _NS3_BF16_PRODUCTS,
                        _ADAMW_PART,
                    ),
                ),
            )
        ),
        TrainCase(
            "text-lm-levers",
            "text-lm",
            _LEVER_ARMS,
            warmups=(0.0, 0.25),
            description="text-lm (batch 32): levers beside K-FAC at its defaults (Muon's "
            "Newton-Schulz iterations, a partial inverse power, the Monte Carlo Fisher, "
            "factor statistics from an eighth of the positions or each sequence's sum, "
            "K-FAC on Muon's AdamW part only, a looser KL clip under SGD, the factors' "
            "step-cost levers together, the leanest step)",
        ),
        TrainCase(
            "text-cnn-levers",
            "text-cnn",
            _CNN_LEVER_ARMS,
            warmups=(0.0, 0.25),
            description="text-cnn (batch 32): the levers that did not lose on "
            "text-lm-levers, beside K-FAC at its defaults",
        ),
        # the suite's own smoke case: minutes, not hours, and every stage of the protocol
        TrainCase(
            "quick",
            "digits-mlp",
            _arms(("sgd",), ("sgd",), ("sgd",)),
            warmups=(0.0, 1.0),
            protocol=Protocol(
                selection_seeds=(0,), heldout_seeds=(1, 2), lr_points=3, budget=7, cutoff=3.0
            ),
            epochs=4,
            quick=True,
            description="digits-mlp in 4 epochs, a 3-lr grid, one selection seed: the "
            "protocol end to end in a minute",
        ),
    )
}


def get_case(name: str) -> TrainCase:
    try:
        return CASES[name]
    except KeyError:
        raise KeyError(f"unknown case {name!r}; choose from {', '.join(CASES)}") from None


def lever_cases() -> list[TrainCase]:
    """The cases that run a lever arm (the columns of the levers across families)."""
    return [c for c in CASES.values() if not c.quick and any(a.tag for a in c.arms)]


def summary_cases() -> list[TrainCase]:
    """The rows of "which K-FAC to use when": each task's own case, and the
    cases that only change its global batch (``text-lm-b128``)."""
    return [c for c in CASES.values() if c.name in (c.task, f"{c.task}-b{c.batch_size}")]
