"""Dense causal MQA attention with document masking on CPU, one point of the lab's variant
space (the search rewrites CONFIG).

- algo: "materialised" (scores [B, H, L, L], masked softmax: the reference's way);
  "sdpa_docs" calls torch's fused attention with is_causal on each document segment;
  "sdpa_mask" one fused call per row with a block-diagonal causal boolean mask;
  "chunked" processes query chunks against their visible key prefix (autograd).
- kv: the shared key/value head given to the H query heads as an expanded view or a copy.
- chunk: queries per chunk for "chunked".
"""

import torch
import torch.nn.functional as F

CONFIG = {"algo": "materialised", "kv": "expand", "chunk": 256}


def _heads(t, H):
    B, n, D = t.shape
    return (
        t[:, None].expand(B, H, n, D) if CONFIG["kv"] == "expand" else t[:, None].repeat(1, H, 1, 1)
    )


def _allowed(doc, t0, t1, s1):
    """[t1 - t0, s1] bool: causal and same document, for queries t0..t1 and keys 0..s1."""
    t = torch.arange(t0, t1)[:, None]
    s = torch.arange(s1)[None, :]
    return (s <= t) & (doc[t0:t1, None] == doc[None, :s1])


def _materialised(q, k, v, doc_ids, scale):
    B, L, H, D = q.shape
    s = torch.einsum("blhd,bsd->bhls", q, k) * scale
    mask = torch.stack([_allowed(doc_ids[b], 0, L, L) for b in range(B)])
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")).float(), dim=-1)
    return torch.einsum("bhls,bsd->blhd", p.to(v.dtype), v)


def _segments(row):
    L = row.shape[0]
    cuts = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
    b = [0, *cuts, L]
    return list(zip(b[:-1], b[1:]))


def _sdpa_docs(q, k, v, doc_ids, scale):
    B, L, H, D = q.shape
    rows = []
    for b in range(B):
        parts = []
        for s0, e0 in _segments(doc_ids[b]):
            qh = q[b : b + 1, s0:e0].transpose(1, 2)
            kh, vh = _heads(k[b : b + 1, s0:e0], H), _heads(v[b : b + 1, s0:e0], H)
            parts.append(F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2)


def _sdpa_mask(q, k, v, doc_ids, scale):
    B, L, H, D = q.shape
    rows = []
    for b in range(B):
        m = _allowed(doc_ids[b], 0, L, L)
        qh = q[b : b + 1].transpose(1, 2)
        kh, vh = _heads(k[b : b + 1], H), _heads(v[b : b + 1], H)
        rows.append(F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, scale=scale))
    return torch.cat(rows).transpose(1, 2)


def _chunked(q, k, v, doc_ids, scale):
    B, L, H, D = q.shape
    C = CONFIG["chunk"]
    rows = []
    for b in range(B):
        parts = []
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            s = torch.einsum("thd,sd->hts", q[b, t0:t1], k[b, :t1]) * scale
            s = s.masked_fill(~_allowed(doc_ids[b], t0, t1, t1)[None], float("-inf"))
            p = torch.softmax(s.float(), dim=-1).to(v.dtype)
            parts.append(torch.einsum("hts,sd->thd", p, v[b, :t1]))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def kernel(q, k, v, doc_ids, scale):
    """q [B, L, H, D]; k, v [B, L, D]; doc_ids [B, L] non-decreasing -> [B, L, H, D]."""
    fn = {"materialised": _materialised, "sdpa_docs": _sdpa_docs, "sdpa_mask": _sdpa_mask,
          "chunked": _chunked}[CONFIG["algo"]]  # fmt: skip
    return fn(q, k, v, doc_ids, scale).contiguous()
