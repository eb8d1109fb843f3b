"""The indexer's KL target (`attention_probs`) in blocks of queries, on every device.

The target is the attention distribution summed over the H query heads and renormalised,
either over the k keys each query selected ([B, L, K], the sparse phase) or over all the keys
it can see ([B, L, L], dense). The reference builds it in one piece: the gathered
[B, L, K, D] keys and [B, L, H, K] fp32 scores (about 64 GiB at L = 128k, H = 64, K = 2048),
or [B, L, H, L] scores. Here a block of C queries at a time gathers only its own [C, K, D]
keys (or reads its visible key span) and scores them, so the extra memory is
O(C * K * max(H, D)) while the output keeps the reference's shape and values.

Queries may be a suffix of the keys (q [B, Lq, ...], k / doc_ids [B, Lk], query i at key
position Lk - Lq + i; `wanka.ops.registry` docstring): blocks are taken over the queries and
the visible key span is found from their key positions.

Generic torch (index_select, bmm, softmax): valid on every device, so it is registered for
all of them.
"""

from __future__ import annotations

import torch

from wanka.ops.common import new_output
from wanka.ops.dense_attention.cpu import check_doc_ids
from wanka.ops.dense_attention.reference import query_offset
from wanka.ops.indexer_kl.chunked import _target, _visible
from wanka.ops.lightning_indexer.cpu import _doc_starts
from wanka.ops.registry import register

# Elements of the largest per-block intermediate ([C, K, D] keys or [C, H, K] scores).
CHUNK_ELEMS = 1 << 24


def block_rows(L: int, width: int, per_row: int, chunk_size: int | None) -> int:
    """Queries per block: chunk_size if given, else as many as keep a [C, width, per_row]
    intermediate under CHUNK_ELEMS."""
    if chunk_size is not None:
        return max(1, min(int(chunk_size), L))
    return max(1, min(L, CHUNK_ELEMS // max(1, width * per_row)))


def _over_selected(q, k, indices, scale, chunk_size):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    out = new_output((B, L, K), torch.float32, q.device)
    C = block_rows(L, K, max(H, D), chunk_size)
    for b in range(B):
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            idx = indices[b, t0:t1]
            k_sel = k[b].index_select(0, idx.clamp(min=0).reshape(-1)).view(t1 - t0, K, D)
            s = torch.bmm(q[b, t0:t1], k_sel.transpose(1, 2)).float().mul_(scale)  # [C, H, K]
            s.masked_fill_((idx < 0)[:, None, :], float("-inf"))
            p = torch.softmax(s, dim=-1).sum(dim=1)
            out[b, t0:t1] = p / p.sum(dim=-1, keepdim=True)
    return out


def _over_visible(q, k, doc_ids, scale, chunk_size):
    B, L, H, _ = q.shape
    Lk = k.shape[1]
    off = query_offset(L, Lk)
    check_doc_ids(doc_ids)
    out = torch.zeros(B, L, Lk, dtype=torch.float32, device=q.device)  # hidden keys get 0
    starts = _doc_starts(doc_ids)
    C = block_rows(L, H, Lk, chunk_size)
    for b in range(B):
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            p0, p1 = off + t0, off + t1  # key positions of the block's queries
            s0 = int(starts[b, p0])  # the block sees keys s0 .. p1 - 1 only
            vis = _visible(p0, p1, s0, starts[b])
            out[b, t0:t1, s0:p1] = _target(q[b, t0:t1], k[b, s0:p1], vis, scale)
    return out


@register("attention_probs", "chunked", device_types=("*",), priority=10)
def attention_probs(
    q: torch.Tensor,
    k: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float,
    indices: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Same contract and values as `reference.attention_probs`: q [B, Lq, H, D], k [B, Lk, D]
    (Lq <= Lk: the queries are the last Lq key positions) -> [B, Lq, K] over `indices`
    [B, Lq, K] (key positions, -1 = empty slot), or [B, Lq, Lk] over the visible keys
    (causal, same document; doc_ids [B, Lk] rows non-decreasing). No gradient. `chunk_size`
    (queries per block; default from the shapes) is for tests."""
    with torch.no_grad():
        if indices is None:
            return _over_visible(q, k, doc_ids, scale, chunk_size)
        return _over_selected(q, k, indices, scale, chunk_size)
