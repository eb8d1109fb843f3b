"""Dense causal MQA attention with document masking: the materialised base implementation."""

from __future__ import annotations

import torch

from wanka.ops.registry import register


def allowed_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, L, L] bool: key s is visible to query t iff s <= t and both are in one document."""
    L = doc_ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=doc_ids.device).tril()
    return causal & (doc_ids[:, :, None] == doc_ids[:, None, :])


@register("dense_attention", "reference")
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, L, H, D]; k, v [B, L, D] (one KV head shared by all query heads) -> [B, L, H, D]."""
    scores = torch.einsum("blhd,bsd->bhls", q, k) * scale
    scores = scores.masked_fill(~allowed_mask(doc_ids)[:, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("bhls,bsd->blhd", probs, v)


@register("attention_probs", "reference")
def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indexer's training target: attention probabilities summed over query heads and
    renormalised, over all visible keys ([B, L, L]) or over the selected ones ([B, L, K])."""
    with torch.no_grad():
        if indices is None:
            scores = torch.einsum("blhd,bsd->blhs", q, k).float() * scale
            scores = scores.masked_fill(~allowed_mask(doc_ids)[:, :, None], float("-inf"))
        else:
            k_sel = gather_rows(k, indices)  # [B, L, K, D]
            scores = torch.einsum("blhd,blkd->blhk", q, k_sel).float() * scale
            scores = scores.masked_fill((indices < 0)[:, :, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).sum(dim=2)
        return p / p.sum(dim=-1, keepdim=True)


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, L, D], indices [B, L, K] (-1 = empty) -> [B, L, K, D]; empty slots read row 0."""
    B, L, K = indices.shape
    flat = indices.clamp(min=0).reshape(B, L * K)
    out = torch.gather(x, 1, flat[..., None].expand(B, L * K, x.shape[-1]))
    return out.view(B, L, K, x.shape[-1])
