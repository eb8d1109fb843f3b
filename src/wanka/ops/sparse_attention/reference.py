"""DSA core attention over the top-k selected keys, MQA form: the gather base implementation.

It materialises the gathered [B, L, K, D] keys and values, which is what the fast backends
(a separate issue) must avoid; it is the definition of correct.
"""

from __future__ import annotations

import torch

from wanka.ops.dense_attention.reference import gather_rows
from wanka.ops.registry import register


@register("sparse_attention", "reference")
def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, L, H, D]; k, v [B, L, D]; indices [B, L, K] int64 (-1 = empty slot) -> [B, L, H, D].

    Callers guarantee every valid index is a key the query may see and that each row has at
    least one valid slot (the indexer always finds the query itself visible).
    """
    k_sel, v_sel = gather_rows(k, indices), gather_rows(v, indices)
    scores = torch.einsum("blhd,blkd->blhk", q, k_sel) * scale
    scores = scores.masked_fill((indices < 0)[:, :, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("blhk,blkd->blhd", probs, v_sel)
