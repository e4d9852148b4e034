"""Levers under measurement: changes to K-FAC a run may carry, tried in the
lab under the benchmark protocol before any is built into the library.

Each is a field of :class:`~kaisa_lab.cli.spec.RunSpec` (written into a
run's record only where it is set) and an arm's variant in a case
(:class:`~kaisa_lab.bench.cases.Arm`):

- ``eigen_power`` *p*: precondition by ``(λ_G λ_Aᵀ + γ)^-p`` in the
  eigenbases, the damped Kronecker factor's *p*-th inverse power
  (:class:`PowerEigen`; ``p = 1`` is kaisa's ``eigen``);
- ``fisher="mc"``: on a factor step, G from a backward against labels
  sampled from the model (the Fisher K-FAC was defined with), the
  gradient from the true labels in a second, uncaptured pass
  (:func:`mc_fisher_backward`: a factor step costs a forward and a
  backward more);
- ``muon_ns_steps``: Muon's Newton–Schulz iterations (the optimizer's);
- ``position_fraction`` *f*: each factor statistic of a sequence layer
  read from a random ``⌈f·T⌉`` of a call's ``T`` positions — the library's
  ``factor_position_fraction`` (:mod:`kaisa.core.positions`), its draws
  seeded per run;
- ``kfac_layers="adamw-part"``: under Muon, K-FAC on the layers Muon hands
  to AdamW only (embeddings, head; :func:`adamw_part_skips`), Muon's
  matrices left to Muon alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from kaisa.core.specs import FactorSpec
from kaisa.methods import eigen

__all__ = [
    "FISHERS",
    "KFAC_LAYERS",
    "PowerEigen",
    "adamw_part_skips",
    "mc_fisher_backward",
]

#: what ``RunSpec.fisher`` may be
FISHERS = ("empirical", "mc")
#: what ``RunSpec.kfac_layers`` may be
KFAC_LAYERS = ("all", "adamw-part")


class PowerEigen(eigen.EigenMethod):
    """The eigen method with the damped eigenvalues raised to ``-p``.

    ``G ⊗ A`` has the eigenvectors ``Q_G ⊗ Q_A`` and the eigenvalues
    ``λ_G λ_Aᵀ``, so ``(G ⊗ A + γ I)^-p`` applied to the gradient is the
    eigen method's product with ``(λ_G λ_Aᵀ + γ)^-p`` in place of its
    inverse.  Between ``p = 0`` (the gradient itself) and ``p = 1`` (K-FAC)."""

    def __init__(self, p: float) -> None:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"eigen_power must be in (0, 1]; got {p}")
        super().__init__(outer_product=True)
        self.p = p

    def _outer(  # type: ignore[override]
        self, factors: Sequence[FactorSpec], state: Mapping[str, Tensor], damping: float
    ) -> Tensor:
        ordered = sorted(factors, key=lambda s: s.axis)
        values = [state[eigen._values(s).key] for s in ordered]
        return (eigen.eigen_outer(values) + damping).pow(-self.p)


def mc_fisher_backward(
    net: nn.Module,
    x: Tensor,
    target: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor],
    paused: Callable[[], AbstractContextManager[object]],
    generator: torch.Generator,
) -> Tensor:
    """A factor step's passes: a captured forward and a backward against one
    label per position sampled from ``softmax(output)`` (kaisa captures A and
    G from them; ``torch.autograd.grad`` leaves ``.grad`` alone), then a
    forward and backward against ``target`` with kaisa's capture ``paused``
    (the gradient the optimizer uses).  Both backwards of one forward would
    both count as captured passes, hence the second forward.  Returns the
    true loss."""
    output = net(x)
    logits = output.detach().reshape(-1, output.shape[-1]).float()
    sampled = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator)
    sampled = sampled.to(target.device).reshape(target.shape)
    params = [p for p in net.parameters() if p.requires_grad]
    torch.autograd.grad(loss(output, sampled), params)
    with paused():
        true = loss(net(x), target)
        true.backward()
    return true


def adamw_part_skips(muon_params: Sequence[str]) -> list[str]:
    """``skip_layers`` patterns that leave out every layer owning one of
    ``muon_params`` (parameter names, ``blocks.0.linear1.weight``): the
    module itself, and the q/k/v rows kaisa registers for an attention's
    packed projection (``blocks.0.self_attn.q``)."""
    modules = dict.fromkeys(name.rpartition(".")[0] for name in muon_params)
    return [rf"^{re.escape(m)}(\.[qkv])?$" for m in modules]
