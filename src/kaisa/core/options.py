"""The option vocabularies the core's math takes: which cost balances the
decompositions, what an oversized factor becomes, what the loss was averaged
over.

Declared here, below every other package, so the core never imports
:mod:`kaisa.config` (which re-exports them as the user-facing names).
"""

from __future__ import annotations

import enum

__all__ = ["AssignmentStrategy", "LargeFactor", "LossAverage", "SameNameEquality"]


class SameNameEquality:
    """Enum mixin: a member also equals another library's member of the same
    enum class name and member name, so a script that switched only its
    import can keep comparing against ``kfac.enums`` members
    (``precond.compute_method == kfac.enums.ComputeMethod.EIGEN``)."""

    name: str

    def __eq__(self, other: object) -> bool:
        if isinstance(other, enum.Enum) and not isinstance(other, type(self)):
            return type(other).__name__ == type(self).__name__ and other.name == self.name
        return bool(super().__eq__(other))

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return super().__hash__()


class AssignmentStrategy(SameNameEquality, str, enum.Enum):
    """Cost model used to balance decompositions over ranks: n³ or n²."""

    COMPUTE = "compute"
    MEMORY = "memory"


class LargeFactor(str, enum.Enum):
    """What a dense factor larger than ``max_factor_dim`` becomes (:mod:`kaisa.core.blocks`).

    * ``DIAGONAL``: its diagonal, ``d`` entries (kfac-jax's diagonal factor;
      kaisa's tied head's ``G``).  Memory does not grow with ``d`` squared.
    * ``BLOCK``: its diagonal blocks of at most ``max_factor_dim`` rows
      (Distributed Shampoo's ``max_preconditioner_dim``), each decomposed on
      its own: ``≈ d · max_factor_dim`` entries.
    """

    DIAGONAL = "diagonal"
    BLOCK = "block"


class LossAverage(str, enum.Enum):
    """What the training loss was averaged over.

    The output gradients seen by the hooks carry a factor 1/(terms averaged);
    the G factor undoes it so that A⊗G approximates the Fisher of the
    mean-reduced loss independently of the batch size.

    * ``BATCH``: ``loss = mean_n ℓ_n`` (classification; the default).
    * ``BATCH_AND_SEQUENCE``: ``loss = mean_{n,s} ℓ_{n,s}`` (language models
      with ``reduction='mean'`` over all tokens).
    * ``SUM``: ``loss = Σ ℓ``; gradients are used unscaled.
    * ``ITEMS``: ``loss = Σ ℓ / N`` over the whole optimizer step (all its
      micro-batches), with ``N`` — e.g. the number of non-ignored tokens —
      set as ``precond.loss_items`` before the step's backward passes (the
      Hugging Face callback sets it from the Trainer's ``num_items_in_batch``).
    """

    BATCH = "batch"
    BATCH_AND_SEQUENCE = "batch_and_sequence"
    SUM = "sum"
    ITEMS = "items"
