"""Dense causal MQA attention with document masking: the materialised base implementation.

Queries may be a suffix of the keys (context parallelism; `wanka.ops.registry` docstring):
q has Lq <= Lk tokens, k / v and doc_ids have Lk, and query i sits at key position
Lk - Lq + i (bottom-right aligned causal).
"""

from __future__ import annotations

import torch

from wanka.ops.common import upcast
from wanka.ops.registry import register


def query_offset(Lq: int, Lk: int) -> int:
    """Key position of query 0 when the Lq queries are the last Lq of the Lk keys."""
    if not 0 <= Lq <= Lk:
        raise ValueError(f"queries must be a suffix of the keys: Lq = {Lq} > Lk = {Lk}")
    return Lk - Lq


def allowed_mask(doc_ids: torch.Tensor, n_queries: int | None = None) -> torch.Tensor:
    """[B, Lq, Lk] bool (Lq = n_queries, default Lk): key s is visible to query t iff
    s <= Lk - Lq + t (its key position) and both are in one document."""
    Lk = doc_ids.shape[1]
    Lq = Lk if n_queries is None else n_queries
    off = query_offset(Lq, Lk)
    causal = torch.ones(Lq, Lk, dtype=torch.bool, device=doc_ids.device).tril(off)
    return causal & (doc_ids[:, off:, None] == doc_ids[:, None, :])


@register("dense_attention", "reference")
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [B, Lk, D] (one KV head shared by all query heads); doc_ids
    [B, Lk] -> [B, Lq, H, D]. Lq <= Lk: the queries are the last Lq key positions."""
    scores = torch.einsum("blhd,bsd->bhls", q, k) * scale
    scores = scores.masked_fill(~allowed_mask(doc_ids, q.shape[1])[:, None], float("-inf"))
    probs = torch.softmax(upcast(scores), dim=-1).to(v.dtype)
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
    renormalised, over all visible keys ([B, Lq, Lk]) or over the selected ones ([B, Lq, K],
    indices are key positions, -1 = empty). q [B, Lq, H, D], k [B, Lk, D], doc_ids [B, Lk]."""
    with torch.no_grad():
        if indices is None:
            scores = torch.einsum("blhd,bsd->blhs", q, k).float() * scale
            mask = allowed_mask(doc_ids, q.shape[1])
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        else:
            k_sel = gather_rows(k, indices)  # [B, Lq, K, D]
            scores = torch.einsum("blhd,blkd->blhk", q, k_sel).float() * scale
            scores = scores.masked_fill((indices < 0)[:, :, None], float("-inf"))
        p = torch.softmax(scores, dim=-1).sum(dim=2)
        return p / p.sum(dim=-1, keepdim=True)


def gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, Lk, D], indices [B, Lq, K] (-1 = empty) -> [B, Lq, K, D]; empty slots read row 0."""
    B, L, K = indices.shape
    flat = indices.clamp(min=0).reshape(B, L * K)
    out = torch.gather(x, 1, flat[..., None].expand(B, L * K, x.shape[-1]))
    return out.view(B, L, K, x.shape[-1])
