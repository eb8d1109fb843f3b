"""MoE token permutation: group token copies by expert (dispatch) and undo it (combine)."""

from __future__ import annotations

import torch

from wanka.ops.registry import register


@register("moe_permute", "reference")
def moe_permute(
    x: torch.Tensor, expert_idx: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D], expert_idx [N, k] -> (x grouped by expert [N*k, D], counts [E], order [N*k]).

    order[i] is the flat (token * k + slot) position of row i; the sort is stable so the
    permutation is deterministic."""
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    token = torch.div(order, expert_idx.shape[1], rounding_mode="floor")
    return x.index_select(0, token), counts, order


@register("moe_unpermute", "reference")
def moe_unpermute(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [N*k, D] in expert order, weights [N, k] -> weighted sum per token [N, D]."""
    N, k = weights.shape
    out = torch.zeros(N * k, y.shape[-1], dtype=y.dtype, device=y.device)
    out = out.index_copy(0, order, y).view(N, k, -1)
    return torch.einsum("nkd,nk->nd", out, weights.to(y.dtype))
