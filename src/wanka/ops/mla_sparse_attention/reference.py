"""The definition (`sparse_attention`'s reference with K = V, the latent part of the output)
and the generic backend every device uses unless a fused one takes the call: the same through
the registry's best `sparse_attention` backend for the device (CPU, Triton, ...)."""

from __future__ import annotations

import torch

from wanka.ops.registry import call, register
from wanka.ops.sparse_attention import reference as sa_ref


def _check(q: torch.Tensor, kv: torch.Tensor, rope_dim: int) -> int:
    C = kv.shape[-1] - rope_dim
    if not 0 < C or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"mla_sparse_attention: q {tuple(q.shape)} and kv {tuple(kv.shape)} "
                         f"must share their last dim, latent + rope_dim ({rope_dim})")  # fmt: skip
    return C


@register("mla_sparse_attention", "reference")
def mla_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                         rope_dim: int) -> torch.Tensor:  # fmt: skip
    C = _check(q, kv, rope_dim)
    return sa_ref.sparse_attention(q, kv, kv, indices, scale)[..., :C]


@register("mla_sparse_attention", "generic", priority=5)
def via_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                         rope_dim: int) -> torch.Tensor:  # fmt: skip
    C = _check(q, kv, rope_dim)
    return call("sparse_attention", q, kv, kv, indices, scale)[..., :C]
