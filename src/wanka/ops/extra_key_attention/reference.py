"""The definition: one softmax over a query's ordinary keys and its own extra keys.

A recursive draft step at position t + s - 1 (s = 2, 3, ...) runs the MTP block on its own
previous output. At inference it attends to the MTP cache, which holds the first pass's keys
up to t and the keys the earlier draft steps of this round wrote at t + 1 .. t + s - 1 (its own
last). Training all t at once (EAGLE-3's "training-time test"), query t therefore sees the first
pass's keys s <= t of its document (or the K slots it selected) and E extra keys that belong to
it alone: one softmax over both sets.

q [B, L, H, D]; k, v [B, L, D] (the first pass, one KV head); doc_ids [B, L]; indices None
(dense: keys s <= t of t's document) or [B, L, K] key positions (-1 = empty slot);
extra_k, extra_v [B, L, E, D] -> [B, L, H, D]. Every query has at least one extra key, so no
row is empty. Materialises [B, L, H, L] (or [B, L, K, D]): meant for the short rows of MTP
tuning, as the other references are the definition rather than the fast path.
"""

from __future__ import annotations

import torch

from wanka.ops.common import upcast
from wanka.ops.dense_attention.reference import allowed_mask
from wanka.ops.registry import register
from wanka.ops.sparse_attention.reference import gather_selected


@register("extra_key_attention", "reference")
def extra_key_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    indices: torch.Tensor | None,
    extra_k: torch.Tensor,
    extra_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if q.shape[1] != k.shape[1] or extra_k.shape[:2] != q.shape[:2]:
        raise ValueError(f"extra_key_attention: queries {tuple(q.shape)}, keys {tuple(k.shape)} "
                         f"and extra keys {tuple(extra_k.shape)} must cover the same positions")  # fmt: skip
    if indices is None:
        scores = torch.einsum("blhd,bsd->blhs", q, k) * scale
        scores = scores.masked_fill(~allowed_mask(doc_ids)[:, :, None], float("-inf"))
        values = None
    else:
        k_sel = gather_selected(k, indices)  # [B, L, K, D]
        scores = torch.einsum("blhd,blkd->blhk", q, k_sel) * scale
        scores = scores.masked_fill((indices < 0)[:, :, None], float("-inf"))
        values = gather_selected(v, indices)
    extra = torch.einsum("blhd,bled->blhe", q, extra_k) * scale
    n = scores.shape[-1]
    probs = torch.softmax(upcast(torch.cat([scores, extra], dim=-1)), dim=-1).to(v.dtype)
    p_keys, p_extra = probs[..., :n], probs[..., n:]
    if values is None:
        out = torch.einsum("blhs,bsd->blhd", p_keys, v)
    else:
        out = torch.einsum("blhk,blkd->blhd", p_keys, values)
    return out + torch.einsum("blhe,bled->blhd", p_extra, extra_v)
