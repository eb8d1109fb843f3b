"""Dense warm-up indexer loss: KL(dense attention || indexer) over all visible keys.

The base implementation, and the definition of correct: the indexer's full [B, L, L] score
matrix (`indexer_scores`) against the full attention target (`attention_probs`, [B, L, H, L]
logits). O(L^2) memory; the `chunked` backend computes the same value and gradients one
block of queries at a time.

Queries may be a suffix of the keys (context parallelism; `wanka.ops.registry` docstring):
q / qi / wi have Lq <= Lk tokens, k / ki / doc_ids have Lk, query i sits at key position
Lk - Lq + i, and the sum runs over the B * Lq queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.dense_attention.reference import attention_probs
from wanka.ops.lightning_indexer.reference import indexer_scores
from wanka.ops.registry import register


def kl_sum(target: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """sum over queries of KL(target || softmax(scores)); -inf scores are empty/invisible keys."""
    hidden = torch.isinf(scores)
    logq = F.log_softmax(scores.float(), dim=-1).masked_fill(hidden, 0.0)
    p = target.masked_fill(hidden, 0.0)
    return (torch.xlogy(p, p) - p * logq).sum()


@register("indexer_kl", "reference")
def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    wi: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Lq, H, D], k [B, Lk, D]: the attention's queries and single key head (the
    target, no gradient); qi [B, Lq, Hi, Di], ki [B, Lk, Di], wi [B, Lq, Hi]: the indexer's
    (gradient); doc_ids [B, Lk]; Lq <= Lk, the queries being the last Lq key positions.
    -> scalar float32: sum over the B * Lq queries of KL(target || softmax(indexer scores)),
    both over the visible keys (causal, same document); the target is the attention
    distribution summed over the H heads and renormalised."""
    scores = indexer_scores(qi, ki, wi, doc_ids)
    target = attention_probs(q, k, doc_ids, scale)
    return kl_sum(target, scores)
