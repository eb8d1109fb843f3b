"""Dense causal MQA attention on CPU without a materialised [B, H, L, L] softmax.

Runs torch's fused `scaled_dot_product_attention` (the CPU flash kernel: blockwise online
softmax, O(L) extra memory, fused backward) with `is_causal=True` on each document segment,
so work outside the block-diagonal causal pattern is skipped instead of masked:

* one document per row: a single SDPA call over the whole batch;
* several documents: one call per document segment of at least `GROUP` tokens; runs of shorter
  documents are packed into groups of about `GROUP` tokens that use a small block-diagonal
  causal boolean mask ([n, n] for a group of n tokens, never [L, L]), which bounds both the
  number of calls and the masked waste.

The single KV head is expanded (a view, no copy) to the H query heads; SDPA's `enable_gqa`
path is avoided because on CPU it is far slower (it falls back to the math kernel).
Backward comes from SDPA's autograd.

Queries may be a suffix of the keys (q [B, Lq, ...], k / v / doc_ids [B, Lk], query i at key
position Lk - Lq + i; `wanka.ops.registry` docstring). Groups wholly after the first query
run as above; groups before it are skipped; the one group that straddles it (its queries
are a suffix of its keys) needs a bottom-right causal mask, which SDPA's `is_causal`
(top-left aligned) is not, so it runs in blocks of queries with an explicit [rows, span]
mask of at most MASK_ELEMS elements.

doc_ids rows must be non-decreasing (packed documents are contiguous runs); this is asserted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.dense_attention.reference import query_offset
from wanka.ops.registry import register

# Documents shorter than this are packed together (with a small mask) into groups of about
# this many tokens; longer ones get their own causal SDPA call.
GROUP = 256
# Elements of one bottom-right causal mask block (query-suffix calls only).
MASK_ELEMS = 1 << 24


def _sdpa(q, k, v, scale, mask=None):
    """q [B, n, H, D], k/v [B, m, D] -> [B, H, n, D] via the device's fused SDPA kernel
    (is_causal when no mask: top-left aligned, so only for n == m)."""
    B, n, H, D = q.shape
    m = k.shape[1]
    kh = k[:, None].expand(B, H, m, D)
    vh = v[:, None].expand(B, H, m, D)
    qh = q.transpose(1, 2)
    if mask is None:
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)


def segments(doc_row: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of the contiguous document runs of one non-decreasing doc_ids row."""
    L = doc_row.shape[0]
    starts = (torch.nonzero(doc_row[1:] != doc_row[:-1]).flatten() + 1).tolist()
    bounds = [0, *starts, L]
    return list(zip(bounds[:-1], bounds[1:]))


def _groups(segs: list[tuple[int, int]], group: int) -> list[list[tuple[int, int]]]:
    """Greedy packing: a long document alone, consecutive short ones up to ~`group` tokens."""
    out, cur, cur_len = [], [], 0
    for s, e in segs:
        if e - s >= group:
            if cur:
                out.append(cur)
                cur, cur_len = [], 0
            out.append([(s, e)])
            continue
        cur.append((s, e))
        cur_len += e - s
        if cur_len >= group:
            out.append(cur)
            cur, cur_len = [], 0
    if cur:
        out.append(cur)
    return out


def check_doc_ids(doc_ids: torch.Tensor) -> None:
    if doc_ids.shape[1] > 1 and bool((doc_ids[:, 1:] < doc_ids[:, :-1]).any()):
        raise ValueError("doc_ids rows must be non-decreasing (contiguous packed documents)")


def _suffix_group(q, k, v, d, scale) -> list[torch.Tensor]:
    """One group whose n_q queries are the last n_q of its n_k keys (q [1, n_q, H, D],
    k / v [1, n_k, D], d [n_k] doc ids): query i sees key j iff j <= n_k - n_q + i and both
    are in one document. Blocks of queries, each over the keys up to its last query."""
    n_q, n_k = q.shape[1], k.shape[1]
    off = n_k - n_q
    rows = max(1, min(n_q, MASK_ELEMS // max(1, n_k)))
    parts = []
    for i0 in range(0, n_q, rows):
        i1 = min(n_q, i0 + rows)
        p0, p1 = off + i0, off + i1  # key positions of the block's queries
        key_pos = torch.arange(p1, device=q.device)
        q_pos = torch.arange(p0, p1, device=q.device)[:, None]
        m = (key_pos[None, :] <= q_pos) & (d[None, :p1] == d[p0:p1, None])
        parts.append(_sdpa(q[:, i0:i1], k[:, :p1], v[:, :p1], scale, mask=m))
    return parts


@register("dense_attention", "cpu", device_types=("cpu",), priority=10)
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [B, Lk, D] (one KV head shared by all query heads); doc_ids
    [B, Lk] -> [B, Lq, H, D]. Lq <= Lk: the queries are the last Lq key positions.

    Same result as the reference (causal + same-document mask, softmax in fp32 accumulation)
    with no [B, H, Lq, Lk] tensor. doc_ids rows must be non-decreasing."""
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    off = query_offset(Lq, Lk)
    check_doc_ids(doc_ids)
    if Lq == 0:
        return q.new_empty(B, 0, H, D)
    if off == 0 and bool((doc_ids[:, 0] == doc_ids[:, -1]).all()):  # one document per row
        return _sdpa(q, k, v, scale).transpose(1, 2).contiguous()
    rows = []
    for b in range(B):
        parts = []
        for grp in _groups(segments(doc_ids[b]), GROUP):
            s0, e0 = grp[0][0], grp[-1][1]
            if e0 <= off:  # every key of the group comes before the first query
                continue
            q0 = max(s0, off)  # key position of the group's first query
            qs = q[b : b + 1, q0 - off : e0 - off]
            ks, vs, d = k[b : b + 1, s0:e0], v[b : b + 1, s0:e0], doc_ids[b, s0:e0]
            if q0 > s0:  # straddles the first query: bottom-right causal
                parts.extend(_suffix_group(qs, ks, vs, d, scale))
            elif len(grp) == 1:
                parts.append(_sdpa(qs, ks, vs, scale))
            else:
                n = e0 - s0
                m = (d[:, None] == d[None, :]) & torch.ones(
                    n, n, dtype=torch.bool, device=q.device
                ).tril()
                parts.append(_sdpa(qs, ks, vs, scale, mask=m))
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    out = torch.cat(rows, dim=0) if B > 1 else rows[0]
    return out.transpose(1, 2).contiguous()


# The code above is plain torch, so every other device gets it too, ahead of the materialised
# reference: SDPA picks that device's fused kernel (flash / memory-efficient) where it has one,
# and where it has none SDPA's math kernel does what the reference does. Not yet run on an
# accelerator. On CUDA the Triton kernel still wins by priority;
# WANKA_OPS_BACKEND=dense_attention=sdpa forces this backend there.
register("dense_attention", "sdpa", device_types=("*",), priority=5)(dense_attention)
