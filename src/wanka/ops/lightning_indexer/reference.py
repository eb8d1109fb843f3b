"""Lightning indexer: score(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)), causal top-k.

Queries may be a suffix of the keys (context parallelism; `wanka.ops.registry` docstring):
q / w have Lq <= Lk tokens, k and doc_ids have Lk, query i sits at key position Lk - Lq + i,
and the indices are key positions. The tie rule (the most recent key wins) makes a query's
selected set the same whichever key prefix it is called with, as long as it holds the
query's document.
"""

from __future__ import annotations

import torch

from wanka.ops.dense_attention.reference import allowed_mask
from wanka.ops.registry import register


@register("indexer_scores", "reference")
def indexer_scores(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor
) -> torch.Tensor:
    """q [B, Lq, Hi, Di], k [B, Lk, Di] (one shared key head), w [B, Lq, Hi], doc_ids
    [B, Lk] -> [B, Lq, Lk] scores, -inf where the key is not visible (future or another
    document). Differentiable."""
    s = torch.einsum("blhd,bsd->blhs", q, k).relu()
    s = torch.einsum("blhs,blh->bls", s, w)
    return s.masked_fill(~allowed_mask(doc_ids, q.shape[1]), float("-inf"))


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k highest scores per row; among equal scores the most recent key wins.

    ReLU scores are often exactly 0, so ties are common. Breaking them by distance to the query
    (not by absolute position, as torch.topk may) keeps a document's result independent of where
    it sits in a packed row, and gives every backend one definition of the selected set."""
    L = scores.shape[-1]
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :k]
    return (L - 1) - order


@register("lightning_indexer", "reference")
def lightning_indexer(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k visible keys per query: q [B, Lq, Hi, Di], k [B, Lk, Di], w [B, Lq, Hi], doc_ids
    [B, Lk] -> (indices [B, Lq, K] int64 key positions with -1 in empty slots, their scores
    [B, Lq, K] with -inf in empty slots, differentiable w.r.t. q, k, w)."""
    scores = indexer_scores(q, k, w, doc_ids)
    kk = min(topk, scores.shape[-1])
    idx = select_topk(scores.detach(), kk)
    top = scores.gather(-1, idx)
    valid = torch.isfinite(top)
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    if kk < topk:  # pad to the configured k so shapes do not depend on L
        pad = topk - kk
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
        top = torch.nn.functional.pad(top, (0, pad), value=float("-inf"))
    return idx, top
