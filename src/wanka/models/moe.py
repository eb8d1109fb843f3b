"""Mixture-of-experts FFN: fine-grained routed experts + shared experts, top-k routing,
auxiliary-loss-free load balancing (a per-expert bias steers selection only).

The forward is split the way Megatron splits it, so communication can overlap compute:
route -> dispatch -> shared experts -> experts -> combine. The dispatcher is local by default;
expert parallelism swaps in an all-to-all dispatcher (distributed/expert_parallel.py).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.layers import FeedForward


class Dispatcher(Protocol):
    def dispatch(
        self, x: torch.Tensor, expert_idx: torch.Tensor, n_experts: int
    ) -> tuple[torch.Tensor, list[int], Any]: ...

    def combine(self, y: torch.Tensor, ctx: Any, weights: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live on this rank: dispatch is a permutation, combine its inverse."""

    def dispatch(self, x, expert_idx, n_experts):
        tokens, counts, order = ops.call("moe_permute", x, expert_idx, n_experts)
        return tokens, counts.tolist(), order

    def combine(self, y, ctx, weights):
        return ops.call("moe_unpermute", y, ctx, weights)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a parameter (experts may be a DTensor sharded over `ep`)."""
    return t.to_local() if hasattr(t, "to_local") else t


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights, so expert parallelism shards dim 0."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w3, w2 = local_tensor(self.w1), local_tensor(self.w3), local_tensor(self.w2)
        outs, start = [], 0
        for e, n in enumerate(counts):
            x = tokens[start : start + n]
            outs.append((F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e])
            start += n
        return torch.cat(outs) if outs else tokens[:0]


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.n_active_experts
        self.route_scale = cfg.route_scale
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        # Selection bias for aux-loss-free balancing; updated from observed load, not by SGD.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        # Tokens routed to each expert since the last bias update (not checkpointed).
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_hidden)
        hidden = cfg.expert_hidden * cfg.n_shared_experts
        self.shared = FeedForward(cfg.dim, hidden) if cfg.n_shared_experts > 0 else None
        self.dispatcher: Dispatcher = LocalDispatcher()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.router(x).float())  # [N, E]
        _, idx = (scores + self.expert_bias).topk(self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True) * self.route_scale
        return idx, w, scores

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, D] -> (y [B, L, D], balance loss); adds this batch's counts to `load`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w, scores = self.route(x)
        counts = torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        with torch.no_grad():
            self.load += counts.to(self.load.dtype)
        tokens, local_counts, ctx = self.dispatcher.dispatch(x, idx, self.n_experts)
        shared = self.shared(x) if self.shared is not None else None
        y = self.dispatcher.combine(self.experts(tokens, local_counts), ctx, w)
        if shared is not None:
            y = y + shared
        # Batch-wise balance loss (DeepSeek-V3's complementary loss): fraction x mean score.
        frac = counts.float() * self.n_experts / (self.top_k * x.shape[0])
        prob = (scores / scores.sum(-1, keepdim=True)).mean(0)
        return y.view(shape), (frac * prob).sum()

    @torch.no_grad()
    def update_bias(self, global_load: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones."""
        self.expert_bias += rate * torch.sign(global_load.mean() - global_load)
        self.load.zero_()
