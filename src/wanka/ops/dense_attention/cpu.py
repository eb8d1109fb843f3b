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

doc_ids rows must be non-decreasing (packed documents are contiguous runs); this is asserted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wanka.ops.registry import register

# Documents shorter than this are packed together (with a small mask) into groups of about
# this many tokens; longer ones get their own causal SDPA call.
GROUP = 256


def _sdpa(q, k, v, scale, mask=None):
    """q [B, n, H, D], k/v [B, n, D] -> [B, H, n, D] via the device's fused SDPA kernel."""
    B, n, H, D = q.shape
    kh = k[:, None].expand(B, H, n, D)
    vh = v[:, None].expand(B, H, n, D)
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


@register("dense_attention", "cpu", device_types=("cpu",), priority=10)
def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, L, H, D]; k, v [B, L, D] (one KV head shared by all query heads) -> [B, L, H, D].

    Same result as the reference (causal + same-document mask, softmax in fp32 accumulation)
    with no [B, H, L, L] tensor. doc_ids [B, L] rows must be non-decreasing."""
    B, L, H, D = q.shape
    check_doc_ids(doc_ids)
    if bool((doc_ids[:, 0] == doc_ids[:, -1]).all()):  # one document per row
        return _sdpa(q, k, v, scale).transpose(1, 2).contiguous()
    rows = []
    for b in range(B):
        parts = []
        for grp in _groups(segments(doc_ids[b]), GROUP):
            s0, e0 = grp[0][0], grp[-1][1]
            qs, ks, vs = q[b : b + 1, s0:e0], k[b : b + 1, s0:e0], v[b : b + 1, s0:e0]
            if len(grp) == 1:
                parts.append(_sdpa(qs, ks, vs, scale))
            else:
                d = doc_ids[b, s0:e0]
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
