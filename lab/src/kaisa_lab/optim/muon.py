"""Muon on the hidden weight matrices, AdamW on everything else: the standard split.

``torch.optim.Muon`` orthogonalises the momentum of a 2-D weight (Newton-Schulz),
which is meaningful only for a matrix that maps one hidden representation to
another; torch's own docstring says embeddings, biases and the like "should be
optimized by a standard method such as AdamW". The split used here is the one
of Keller Jordan's Muon (modded-nanogpt, the CIFAR-10 speedruns) and of
Moonlight:

- **Muon**: every weight with two or more dimensions of a hidden layer:
  ``nn.Linear`` weights, attention's packed ``in_proj_weight`` (one
  ``[3d, d]`` matrix, as early modded-nanogpt's packed ``c_attn``), and
  convolution filters. The first layer of an MLP or CNN counts as hidden
  (airbench puts every conv filter on Muon): only a lookup table is an
  "input embedding".
- **AdamW**: ``nn.Embedding`` weights (a lookup table: each row sees only its
  own tokens' gradient, not a linear map), the output head (its rows are
  per-class scores that should move with their own gradient's scale, not be
  orthogonalised together), and every parameter with fewer than two
  dimensions (biases, LayerNorm/BatchNorm gains).

The head is the last ``nn.Linear`` or convolution in ``model.modules()`` order
unless named: every model of :mod:`kaisa_lab.tasks` registers its output layer
last (tests check that this layer produces the model's output).

Convolution filters (3-D for ``Conv1d``, 4-D for ``Conv2d``) are flattened to
``[out_channels, in_channels * kernel]``, as Keller Jordan's Muon does, by
giving torch's Muon a 2-D *view* of the filter's storage: the update torch's
Muon computes is written straight into the filter. Its learning-rate
adjustment then sees the flattened shape, as in the reference code.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MuonSplit", "MuonWithAdamW", "muon_split"]

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class MuonSplit:
    """Which parameters (by ``named_parameters`` name) go to Muon and which to AdamW."""

    muon: tuple[str, ...]
    adamw: tuple[str, ...]
    head: str


def _default_head(model: nn.Module) -> str:
    last = None
    for name, module in model.named_modules():
        if isinstance(module, _LAYERS) and getattr(module, "weight", None) is not None:
            last = name
    if last is None:
        raise ValueError("muon_split: the model has no nn.Linear or convolution to be the head")
    return last


def muon_split(model: nn.Module, head: str | None = None) -> MuonSplit:
    """Split ``model``'s trainable parameters between Muon and AdamW (module docstring).

    ``head`` names the output layer (default: the last ``nn.Linear`` or
    convolution registered). A parameter shared by several modules is placed
    once, by its first name.
    """
    head = _default_head(model) if head is None else head
    modules = dict(model.named_modules())
    if head not in modules:
        raise ValueError(f"muon_split: head {head!r} is not a module of the model")
    embedding_or_head = {
        id(p)
        for name, module in modules.items()
        if isinstance(module, nn.Embedding) or name == head
        for p in module.parameters(recurse=False)
    }
    muon: list[str] = []
    adamw: list[str] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        hidden_matrix = param.dim() >= 2 and id(param) not in embedding_or_head
        (muon if hidden_matrix else adamw).append(name)
    return MuonSplit(tuple(muon), tuple(adamw), head)


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the split's Muon parameters, ``torch.optim.AdamW`` on the rest.

    One optimizer object so that the training loop, a learning-rate schedule
    and K-FAC (which reads ``param_groups[0]['lr']`` for its KL clip: the
    Muon lr) see a single optimizer: :attr:`param_groups` *are* the two inner
    optimizers' groups (Muon's first), so writing a group's ``lr`` reaches the
    optimizer that uses it. Both run exactly as torch implements them.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        adamw_lr: float,
        adamw_weight_decay: float,
        head: str | None = None,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ) -> None:
        self.split = muon_split(model, head)
        params = dict(model.named_parameters())
        # (parameter, 2-D view Muon updates); the view shares the parameter's storage
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        for name in self.split.muon:
            p = params[name]
            if not p.is_contiguous():
                raise ValueError(f"MuonWithAdamW: {name} is not contiguous; cannot view it as 2-D")
            self._views.append((p, p.detach().view(p.shape[0], -1)))
        self.muon = torch.optim.Muon(
            [v for _, v in self._views],
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            ns_steps=ns_steps,
        )
        self.adamw = torch.optim.AdamW(
            [params[n] for n in self.split.adamw], lr=adamw_lr, weight_decay=adamw_weight_decay
        )
        super().__init__([{"params": [p for p, _ in self._views]}], {})
        # Share the inner optimizers' group dicts (after Optimizer.__init__ built its own).
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One Muon step on the hidden matrices (their current gradients, viewed
        as 2-D) and one AdamW step on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, view in self._views:
            view.grad = None if p.grad is None else p.grad.reshape(view.shape)
        self.muon.step()
        self.adamw.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model parameters' gradients (and the 2-D views' copies)."""
        for p, view in self._views:
            view.grad = None
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Both inner optimizers' state dicts."""
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # torch's load_state_dict builds new group dicts: share them again
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    def parameters_of(self, which: str) -> Iterable[torch.Tensor]:
        """The model parameters ``'muon'`` or ``'adamw'`` updates."""
        if which == "muon":
            return [p for p, _ in self._views]
        if which == "adamw":
            return [p for g in self.adamw.param_groups for p in g["params"]]
        raise ValueError(f"which must be 'muon' or 'adamw'; got {which!r}")
