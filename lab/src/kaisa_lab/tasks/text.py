"""Character-level language modelling on the text of Python's own documentation.

``pydoc_data.topics`` ships with every CPython (~465k characters of English
technical prose), so the task needs no download and its data is identical on
every machine with the same Python version. The last 10% is held out for
validation; the metric is validation bits per character (lower is better).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from kaisa_lab.tasks.base import (
    BatchDataset,
    Defaults,
    EvalSums,
    Metric,
    Task,
    TaskData,
    bits_per_char,
)
from kaisa_lab.tasks.convlm import CharConvNet
from kaisa_lab.tasks.transformer import CharTransformer

__all__ = ["TextConvTask", "TextLMLargeTask", "TextLMTask", "WindowDataset", "load_corpus"]

VALIDATION_FRACTION = 0.1


@functools.lru_cache(maxsize=1)
def load_corpus() -> tuple[str, tuple[str, ...]]:
    """Return the corpus text (topics joined in sorted-key order) and its alphabet.

    The alphabet is the sorted set of characters of the whole text, so the
    validation part has no out-of-vocabulary characters.
    """
    from pydoc_data.topics import topics

    text = "".join(topics[key] for key in sorted(topics))
    return text, tuple(sorted(set(text)))


class WindowDataset(BatchDataset):
    """Windows of ``context + 1`` tokens: inputs are the first ``context``, targets the last.

    With ``stride=1`` (training) every offset is a sample, so an epoch of
    sampled batches sees varied alignments; with ``stride=context``
    (validation) the windows tile the text without overlap, so every token is
    scored exactly once.
    """

    def __init__(self, tokens: torch.Tensor, context: int, stride: int = 1) -> None:
        if tokens.dim() != 1 or tokens.numel() <= context:
            raise ValueError(f"need a 1-D token tensor longer than the context ({context})")
        self.tokens = tokens
        self.context = context
        self.stride = stride
        self._offsets = torch.arange(context + 1)

    def __len__(self) -> int:
        return (self.tokens.numel() - 1 - self.context) // self.stride + 1

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[indices.unsqueeze(1) * self.stride + self._offsets]
        return windows[:, :-1], windows[:, 1:]


class TextLMTask(Task):
    """A 2-layer, 128-wide character Transformer on the pydoc topics corpus."""

    name = "text-lm"
    description = (
        "character-level Transformer LM on Python's pydoc topics, scored by validation bits/char"
    )
    metric = Metric("bits_per_char", higher_is_better=False)
    target = 2.5
    loss_average = "batch_and_sequence"
    # An epoch is 200 sampled batches (~13 s on one CPU thread). Tuned for time
    # to 2.5 bits/char in issue 10 (docs/results.md: benchmarks/tune_digits.py
    # --task text-lm, --optimizer adamw --evals-per-epoch 10, one thread, 2 seeds
    # per configuration, 3 to confirm): AdamW at lr 0.002 with a quarter epoch
    # of warm-up and a cosine over the 5 epochs reaches it in a median 360
    # steps (constant lr 0.003: 520); K-FAC on top of it (inverse, factors
    # every 10 steps, inverses every 50, damping 0.1) in 240 steps, against
    # 310-340 for the eigen method at any damping in 0.01-0.1; at 1.18x the
    # cost of an AdamW step, its median time to target is 0.79x AdamW's. The
    # KL clip is off: 0.01 gave the same steps on every seed (it never bound).
    # Attention and embeddings are preconditioned.  Each arm tuned on its own
    # (session 8): AdamW needs its warm-up (no warm-up: 400-450 steps), K-FAC
    # does not (215 against 230 steps on seeds 0-1; 220 on seeds 0-4, 0.68x
    # AdamW's time), so the K-FAC arm starts at the full lr.  Today's baselines
    # (issue 23, docs/results.md: one seed, this schedule, steps to 2.5 read
    # every 20, the middle lr of the fewest-steps plateau): Muon 0.02 on the
    # hidden matrices (180 steps at 0.01-0.04; its AdamW part at AdamW's 0.002),
    # SOAP 0.008 (140 at 0.005-0.012), Shampoo (heavyball's KLShampoo) 0.008
    # (160 at 0.005-0.012), LAMB 0.01 (360); weight decay AdamW's 0.01.
    defaults = Defaults(
        epochs=5,
        batch_size=32,
        optimizer="adamw",
        lr={
            "sgd": 0.1,
            "adam": 0.003,
            "adamw": 0.002,
            "muon": 0.02,
            "soap": 0.008,
            "shampoo": 0.008,
            "lamb": 0.01,
        },
        steps_per_epoch=200,
        eval_batch_size=256,
        schedule="cosine",
        warmup_epochs=0.25,
        # Muon tuned its own schedule too (session 12): without warm-up it
        # reaches 2.5 in 140 steps (seeds 0-4, read every 10) against 170 with
        # AdamW's quarter epoch; its lr was swept with the warm-up.
        warmup_by_optimizer={"muon": 0.0},
        kfac={
            "compute_method": "inverse",
            "factor_update_steps": 10,
            "inv_update_steps": 50,
            "damping": 0.1,
            "kl_clip": None,
        },
        # Under Muon (session 12, docs/results.md "Muon + K-FAC"): inverse or
        # eigen, damping 0.03-0.3, factors/inverses every 10/50 or 20/100 all
        # took 140 steps on seeds 0-2 read every 20 (eigen at 0.03: 160), so
        # the cheaper 20/100; read every 10 steps on seeds 0-4: 130 against
        # Muon's 170.
        kfac_arm={
            "warmup_epochs": 0.0,
            "kfac": {"muon": {"factor_update_steps": 20, "inv_update_steps": 100}},
        },
    )

    context = 64
    d_model = 128
    n_heads = 4
    n_layers = 2
    #: Score only the first this many validation windows (``None``: all of the
    #: held-out 10%).  A fixed prefix of the same tiling, so the metric is the
    #: same kind of number, just cheaper to read on a larger model.
    validation_windows: int | None = None

    def vocabulary(self) -> tuple[str, ...]:
        """The characters the model predicts, in token-id order."""
        return load_corpus()[1]

    def load(self, data_dir: Path | None = None) -> TaskData:
        text, alphabet = load_corpus()
        index = {ch: i for i, ch in enumerate(alphabet)}
        tokens = torch.tensor([index[ch] for ch in text], dtype=torch.int64)
        split = int(len(tokens) * (1.0 - VALIDATION_FRACTION))
        held_out = tokens[split:]
        if self.validation_windows is not None:
            # windows tile with stride = context; +1 for the last window's target
            held_out = held_out[: self.validation_windows * self.context + 1]
        return TaskData(
            train=WindowDataset(tokens[:split], self.context),
            test=WindowDataset(held_out, self.context, stride=self.context),
        )

    def build_model(self) -> nn.Module:
        return CharTransformer(
            vocab_size=len(self.vocabulary()),
            context=self.context,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
        )

    def summarize(self, sums: EvalSums) -> dict[str, float]:
        out = super().summarize(sums)
        out["bits_per_char"] = bits_per_char(out["loss"])
        return out


class TextConvTask(TextLMTask):
    """The same corpus, windows and metric as :class:`TextLMTask`, modelled by
    a causal dilated convolutional network (:class:`CharConvNet`).

    Written after the library's K-FAC defaults were chosen (issue 10's blind
    family on text): at the library's defaults K-FAC took 0.89x AdamW's time
    here.  Tuned on top of the tuned AdamW (docs/results.md), its task
    defaults below take 0.65x.
    """

    name = "text-cnn"
    description = (
        "causal dilated convolutional character LM on Python's pydoc topics, scored by "
        "validation bits/char"
    )
    # The tuned baseline (docs/results.md, 2 seeds, steps to 2.5 bits/char read
    # every 20): AdamW at lr 0.01 with a quarter epoch of warm-up and a cosine
    # over 3 epochs, 160 steps (lr 0.005: 240; 0.012 diverges; constant lr
    # 0.003: 280).  K-FAC at the library's defaults on it: 130 steps.  Tuned
    # (55 settings, 2 seeds each): the K-FAC arm at lr 0.008 with no warm-up
    # and a tight KL clip (1e-5 to 1e-4; it binds on the first ~24 steps only,
    # nu rising from 0.2 to 1) takes 90 steps on seeds 0-4; any one of the
    # three alone, 105-125.  Inverses every 50 steps: 90 on every
    # seed, where every 100 gave 90-100.  Muon (session 12, docs/results.md
    # "text-cnn against Muon"; seed 0, read every 10): lr 0.01/0.02/0.04 with
    # the warm-up 210/150/110 steps, without 170/110/80, and 0.08 and 0.16
    # without 70; at 0.08 without warm-up 70 on seeds 0-2.  SOAP, Shampoo and
    # LAMB (issue 23's last measurements, docs/results.md "The other baselines
    # tuned"; seed 0, read every 10): SOAP with the warm-up 0.005/0.01/0.02/0.04
    # took 120/100/110/110 steps, without it 0.005/0.007/0.01/0.014/0.02
    # took 100/80/60/60/90; Shampoo with 0.005/0.01/0.02/0.04 170/130/100/220,
    # without at 0.01/0.02/0.04 110/90/110; LAMB needs the warm-up (without it
    # 0.04 and 0.08 miss the target): 0.01/0.02/0.04/0.08/0.11/0.16 missed/380/
    # 190/180/missed/missed.
    defaults = Defaults(
        epochs=3,
        batch_size=32,
        optimizer="adamw",
        lr={
            "sgd": 0.1,
            "adam": 0.003,
            "adamw": 0.01,
            "muon": 0.08,
            "soap": 0.01,
            "shampoo": 0.02,
            "lamb": 0.08,
        },
        warmup_by_optimizer={"muon": 0.0, "soap": 0.0, "shampoo": 0.0},
        steps_per_epoch=200,
        eval_batch_size=256,
        schedule="cosine",
        warmup_epochs=0.25,
        kfac={
            "compute_method": "inverse",
            "factor_update_steps": 10,
            "inv_update_steps": 50,
            "damping": 0.3,
            "kl_clip": 1e-5,
        },
        kfac_arm={"lr": {"adamw": 0.008}, "warmup_epochs": 0.0},
    )

    def build_model(self) -> nn.Module:
        return CharConvNet(vocab_size=len(self.vocabulary()))


class TextLMLargeTask(TextLMTask):
    """:class:`TextLMTask` at 4 blocks of width 256 (3.2M parameters, 7.5x text-lm's).

    Issue 23's larger LM: the same corpus, training windows and held-out 10%,
    scored on a fixed prefix of the held-out tiling (256 windows, 16,384
    characters, 35% of it) so that a reading costs ~1.3 CPU-seconds (about
    two training steps) rather than 2.8x that.  Context stays at text-lm's 64:
    at 128 a step cost 2.6x more on one thread, and the issue's 10-20 minute
    budget would have been a few hundred steps.  Budget, target and the arms
    measured so far: docs/results.md, "text-lm-large (issue 23, item 3)".
    """

    name = "text-lm-large"
    description = (
        "4-block, 256-wide character-level Transformer LM on Python's pydoc topics, scored by "
        "bits/char on a fixed validation slice"
    )
    # Budgeted in issue 23 (docs/results.md, "text-lm-large (issue 23, item
    # 3)", one seed, metric read every 20 steps, one thread): AdamW at lr 1e-3
    # with text-lm's schedule shape (a quarter epoch of warm-up, cosine over 5
    # epochs of 200 steps) reaches 2.03 bits/char at step 920 of its 1000 and
    # ends at 2.02; 920 steps are 8.7 minutes of one thread (566 ms a step
    # on a quiet core), short of the 10-20 minutes: ~7 epochs would
    # put it mid-range (not run; the command is in results.md).  lr 2e-3
    # was behind at every reading up to step 540 (2.41 against 2.29).  On seeds
    # 0-2 (medians): AdamW 900 steps, AdamW + K-FAC 520, Muon 0.02 500 and
    # Muon + K-FAC at 0.02 420.  Muon's lr is 0.01: 460 steps on each of seeds
    # 0-2 (seed 0: 0.04 behind 0.02 at every reading from step 200, 0.005 took
    # 500), and Muon + K-FAC at 0.01 380 (1.00x Muon's time).  Muon
    # keeps AdamW's warm-up here, unlike text-lm and text-cnn: without it (seed
    # 0) lr 0.02 took 520 steps against 500, and 0.04 was behind from step 160.
    # SOAP 3e-3 (text-lm's lr scaled as AdamW's) took 460 steps on seed 0.
    # SOAP, Shampoo and LAMB were swept only until they could not come within
    # 1.15x of Muon's time (docs/results.md, "The other baselines tuned"): at
    # 2.4x and 3.3x Muon's step cost SOAP (0.003, 0.006) and Shampoo (0.004)
    # are far behind at the steps they could afford, so their lrs stay their
    # libraries' (kaisa compare says they are not tuned here).  LAMB, at
    # AdamW's step cost, follows AdamW's curve at its best lr, 0.01 (0.005 and
    # 0.02 behind it at every reading, 0.04 stalls; runs cut at step 640,
    # where 0.01 reads 2.17 and AdamW 2.16).  SGD's and Adam's lrs are
    # unmeasured.  The budget stays short of the 10-20 minutes
    # (AdamW: 8.3-8.7 min of training to 2.03), a stated deviation.
    target = 2.03
    defaults = Defaults(
        epochs=5,
        batch_size=32,
        optimizer="adamw",
        lr={"sgd": 0.1, "adam": 0.001, "adamw": 0.001, "muon": 0.01, "lamb": 0.01},
        steps_per_epoch=200,
        eval_batch_size=256,
        schedule="cosine",
        warmup_epochs=0.25,
        kfac={
            "compute_method": "inverse",
            "factor_update_steps": 10,
            "inv_update_steps": 50,
            "damping": 0.1,
            "kl_clip": None,
        },
        # K-FAC on Muon: bfloat16 products (the Grams and the preconditioning;
        # 2x float32's speed on this CPU) and factors/inverses every 20/100:
        # the same 380/380/400 steps as float32 at 10/50, at 1.13x Muon's step
        # against 1.23x (docs/results.md, "text-lm-large: K-FAC's products in
        # bfloat16"); K-FAC on AdamW keeps float32 (not measured in bfloat16)
        kfac_arm={
            "warmup_epochs": 0.0,
            "kfac": {
                "muon": {
                    "factor_update_steps": 20,
                    "inv_update_steps": 100,
                    "precondition_dtype": "bfloat16",
                    "factor_compute_dtype": "bfloat16",
                }
            },
        },
    )

    d_model = 256
    n_heads = 4
    n_layers = 4
    validation_windows = 256
