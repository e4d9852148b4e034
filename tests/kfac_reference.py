"""Dense float64 references for the K-FAC math, written independently of kaisa.

Factors come from explicit per-row outer products; output gradients are the
per-example gradients ``∂ℓ_n/∂z`` obtained by differentiating the *summed*
per-example losses (so the 1/N of a mean loss never enters); Fisher blocks
are built with ``torch.kron`` and solved exactly with ``torch.linalg.solve``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def vec(x: Tensor) -> Tensor:
    """Column-stacking vec: ``(A⊗G) vec(X) = vec(G X A)`` for symmetric A."""
    return x.t().reshape(-1)


def unvec(v: Tensor, rows: int, cols: int) -> Tensor:
    return v.reshape(cols, rows).t()


def outer_mean(rows: Tensor) -> Tensor:
    """(1/R) Σ_r x_r x_rᵀ by an explicit sum of outer products."""
    return sum(torch.outer(r, r) for r in rows) / rows.shape[0]


def with_ones(rows: Tensor) -> Tensor:
    return torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], dim=1)


def conv_patches(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """Patches [N·L, C·kh·kw] built with F.unfold from an explicitly padded input."""
    if isinstance(conv.padding, str):
        kh, kw = conv.kernel_size
        dh, dw = conv.dilation
        if conv.padding == "valid":
            pads = (0, 0, 0, 0)
        else:  # 'same' (stride 1): total d(k-1), extra pixel on the right/bottom
            th, tw = dh * (kh - 1), dw * (kw - 1)
            pads = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
    else:
        ph, pw = conv.padding
        pads = (pw, pw, ph, ph)
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    xp = F.pad(x, pads, mode=mode)
    cols = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def dense_precondition(grad: Tensor, A: Tensor, G: Tensor, damping: float) -> Tensor:
    """``(A⊗G + γI)⁻¹ vec(∇)`` by an exact dense solve."""
    fisher = torch.kron(A, G)
    rhs = vec(grad)
    v = torch.linalg.solve(fisher + damping * torch.eye(fisher.shape[0], dtype=fisher.dtype), rhs)
    return unvec(v, grad.shape[0], grad.shape[1])


def dense_precondition_pi(grad: Tensor, A: Tensor, G: Tensor, damping: float) -> Tensor:
    """``((A + π√γ I) ⊗ (G + √γ/π I))⁻¹ vec(∇)``: factored Tikhonov damping."""
    pi = torch.sqrt((torch.trace(A) / A.shape[0]) / (torch.trace(G) / G.shape[0]))
    s = damping**0.5
    Ad = A + pi * s * torch.eye(A.shape[0], dtype=A.dtype)
    Gd = G + (s / pi) * torch.eye(G.shape[0], dtype=G.dtype)
    v = torch.linalg.solve(torch.kron(Ad, Gd), vec(grad))
    return unvec(v, grad.shape[0], grad.shape[1])


def grad_matrix(module: nn.Module) -> Tensor:
    w = module.weight.grad.reshape(module.weight.shape[0], -1)
    if getattr(module, "bias", None) is not None:
        w = torch.cat([w, module.bias.grad.reshape(-1, 1)], dim=1)
    return w


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-300))


def per_example_output_grads(
    model: nn.Module, layer: nn.Module, x: Tensor, per_example_loss
) -> tuple[Tensor, Tensor]:
    """(layer input, ∂(Σ_n ℓ_n)/∂z) for one forward; ``per_example_loss(out) -> [N]``."""
    store: dict[str, Tensor] = {}

    def hook(mod: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> Tensor:
        store["x"] = inp[0].detach()
        store["z"] = out
        # hand a copy downstream so an in-place activation cannot overwrite z
        return out + 0

    handle = layer.register_forward_hook(hook)
    try:
        out = model(x)
        total = per_example_loss(out).sum()
        z_grad = torch.autograd.grad(total, store["z"])[0]
    finally:
        handle.remove()
    return store["x"], z_grad
