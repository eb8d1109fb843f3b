"""Mixture-of-experts FFN: fine-grained routed experts + shared experts, top-k routing
(optionally group-limited), auxiliary-loss-free load balancing (a per-expert bias steers
selection only) plus optional batch-wise and sequence-wise balance losses.

The forward is split the way Megatron splits it, so communication can overlap compute:
route -> dispatch -> shared experts -> experts -> combine. The dispatcher is local by default;
expert parallelism swaps in an all-to-all dispatcher (distributed/expert_parallel.py). The
local experts run at once through the `grouped_swiglu` op (ops/grouped_experts/): the
per-expert row counts stay a device tensor, read on the host only by a backend that needs
them (`_grouped_mm` on CPU and CUDA sm90+ bf16 does not; the padded bmm reads their maximum)
and by the all-to-all, for its split sizes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.layers import FeedForward, Linear
from wanka.ops import grouped_experts  # noqa: F401  (registers the grouped_swiglu op)


class Dispatcher(Protocol):
    def dispatch(
        self, x: torch.Tensor, expert_idx: torch.Tensor, n_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """-> (rows grouped by local expert, row count per local expert [E_local] as a device
        tensor, context for combine)."""
        ...

    def arrived(self, tokens: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The dispatched rows, once there: a dispatcher may return from `dispatch` with its
        exchange still in flight, so the shared experts compute meanwhile."""
        ...

    def combine(self, y: torch.Tensor, ctx: Any, weights: torch.Tensor) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live on this rank: dispatch is a permutation, combine its inverse."""

    def dispatch(self, x, expert_idx, n_experts):
        return ops.call("moe_permute", x, expert_idx, n_experts)  # no host sync

    def arrived(self, tokens, ctx):
        return tokens

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

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """tokens [R, D] grouped by expert, counts [E] rows per expert -> [R, D]."""
        w1, w3, w2 = local_tensor(self.w1), local_tensor(self.w3), local_tensor(self.w2)
        counts = torch.as_tensor(counts, device=tokens.device)
        return ops.call("grouped_swiglu", tokens, counts, w1, w3, w2)


class MoELosses(NamedTuple):
    """Balance losses of one MoE layer (both depend on the router only)."""

    balance: torch.Tensor  # batch-wise: over all tokens of the micro-batch
    seq_balance: torch.Tensor  # sequence-wise: per row, averaged over rows


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.n_active_experts
        self.route_scale = cfg.route_scale
        # Group-limited routing (DeepSeek-V3's n_group / topk_group); 1 of 1 = unrestricted.
        self.n_groups, self.n_limited_groups = cfg.n_expert_groups, cfg.n_limited_groups
        self.router = Linear(cfg.dim, cfg.n_experts, bias=False)
        # Selection bias for aux-loss-free balancing; updated from observed load, not by SGD.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        # Tokens routed to each expert since the last bias update (not checkpointed).
        self.register_buffer("load", torch.zeros(cfg.n_experts), persistent=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_hidden)
        hidden = cfg.expert_hidden * cfg.n_shared_experts
        self.shared = FeedForward(cfg.dim, hidden) if cfg.n_shared_experts > 0 else None
        self.dispatcher: Dispatcher = LocalDispatcher()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (expert indices [N, k], combine weights [N, k], affinities [N, E])."""
        scores = torch.sigmoid(self.router(x).float())  # [N, E]
        biased = scores + self.expert_bias
        if self.n_limited_groups < self.n_groups:
            biased = self._limit_groups(biased)
        _, idx = biased.topk(self.top_k, dim=-1)
        w = scores.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True) * self.route_scale
        return idx, w, scores

    def _limit_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Keep each token's best n_limited_groups expert groups (group score: the sum of its
        top-2 biased affinities, top-1 for one-expert groups); mask the others' experts."""
        N, E = biased.shape
        grouped = biased.view(N, self.n_groups, E // self.n_groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_score.topk(self.n_limited_groups, dim=-1).indices  # [N, n_limited]
        mask = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(mask[..., None], float("-inf")).view(N, E)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoELosses]:
        """x [B, L, D] -> (y [B, L, D], balance losses); adds this batch's counts to `load`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w, scores = self.route(x)
        counts = torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        with torch.no_grad():
            self.load += counts.to(self.load.dtype)
        tokens, local_counts, ctx = self.dispatcher.dispatch(x, idx, self.n_experts)
        shared = self.shared(x) if self.shared is not None else None  # overlaps the dispatch
        tokens = self.dispatcher.arrived(tokens, ctx)
        y = self.dispatcher.combine(self.experts(tokens, local_counts), ctx, w)
        if shared is not None:
            y = y + shared
        return y.view(shape), self.balance_losses(idx, scores, counts, shape[0])

    def balance_losses(
        self, idx: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor, n_seq: int
    ) -> MoELosses:
        """DeepSeek-V3's complementary balance losses, sum_i f_i * P_i with
        f_i = E / (k * T) * (tokens selecting expert i) and P_i = mean over the tokens of
        s_i / sum_j s_j: over all T tokens of the micro-batch (batch-wise), and per sequence
        (T = its length) averaged over the sequences (sequence-wise). Gradient only via P."""
        E, k = self.n_experts, self.top_k
        prob = scores / scores.sum(-1, keepdim=True)  # [N, E]
        frac = counts.float() * E / (k * idx.shape[0])
        batch = (frac * prob.mean(0)).sum()
        T = idx.shape[0] // n_seq
        sel = idx.reshape(n_seq, T * k)
        seq_counts = scores.new_zeros(n_seq, E).scatter_add_(1, sel, scores.new_ones(sel.shape))
        seq_frac = seq_counts * E / (k * T)
        seq = (seq_frac * prob.view(n_seq, T, E).mean(1)).sum(-1).mean()
        return MoELosses(batch, seq)

    @torch.no_grad()
    def update_bias(self, global_load: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones."""
        self.expert_bias += rate * torch.sign(global_load.mean() - global_load)
        self.load.zero_()
