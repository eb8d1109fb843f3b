"""Small building blocks: Linear, RMSNorm, rotary embeddings, SwiGLU feed-forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wanka import ops


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) whose product is the op registry's
    `linear`, so a device backend can choose the GEMM (e.g. the CPU's few-row decode path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.call("linear", x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """[max_seq_len, head_dim // 2, 2] cos/sin table."""
    inv = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    ang = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, L, ..., D] rotated by per-token positions [B, L] (per-document positions)."""
    half = x.shape[-1] // 2
    cs = table[positions]  # [B, L, D/2, 2]
    while cs.dim() < x.dim() + 1:
        cs = cs.unsqueeze(2)
    cos, sin = cs[..., 0], cs[..., 1]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class FeedForward(nn.Module):
    """SwiGLU MLP, used for dense layers and the shared experts."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
