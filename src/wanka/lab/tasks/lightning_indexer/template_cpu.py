"""Lightning indexer (ReLU multi-head scores, causal + document top-k) on CPU, one point of
the lab's variant space (the search rewrites CONFIG).

- algo: "full" scores all [L, L] pairs per row (the reference's way); "chunked" scores a
  chunk of queries against the keys they can see only (0 .. last query of the chunk).
- chunk: queries per chunk.
- grad: "gather" takes the selected scores out of the (differentiable) score tile;
  "recompute" scores only the k selected keys again, differentiably, so autograd keeps
  [c, K] per chunk instead of the tile.
- select: "sort" (stable sort of the reversed row: the reference's tie rule, most recent
  key first) or "topk" (torch.topk on the reversed row: faster, ties not guaranteed).
"""

import torch

CONFIG = {"algo": "full", "chunk": 256, "grad": "gather", "select": "sort"}


def _tile(q_c, k_s, w_c):
    """q_c [c, Hi, Di], k_s [S, Di], w_c [c, Hi] -> [c, S]."""
    return torch.einsum("chs,ch->cs", torch.einsum("chd,sd->chs", q_c, k_s).relu(), w_c)


def _select(scores, kk):
    S = scores.shape[-1]
    rev = scores.detach().flip(-1)
    if CONFIG["select"] == "topk":
        order = rev.topk(kk, dim=-1).indices
    else:
        order = torch.sort(rev, dim=-1, descending=True, stable=True).indices[..., :kk]
    return (S - 1) - order


def _chunk(q, k, w, doc, t0, t1, topk):
    """Queries t0..t1 of one row -> (indices [c, topk], scores [c, topk])."""
    S = t1 if CONFIG["algo"] == "chunked" else q.shape[0]
    sc = _tile(q[t0:t1], k[:S], w[t0:t1])
    t = torch.arange(t0, t1)[:, None]
    s = torch.arange(S)[None, :]
    sc = sc.masked_fill(~((s <= t) & (doc[t0:t1, None] == doc[None, :S])), float("-inf"))
    kk = min(topk, S)
    idx = _select(sc, kk)
    if CONFIG["grad"] == "recompute":
        top = sc.detach().gather(-1, idx)
        valid = torch.isfinite(top)
        ks = k[idx.clamp(min=0)]  # [c, kk, Di]
        re = torch.einsum("chk,ch->ck", torch.einsum("chd,ckd->chk", q[t0:t1], ks).relu(), w[t0:t1])
        top = torch.where(valid, re, torch.full_like(re, float("-inf")))
    else:
        top = sc.gather(-1, idx)
        valid = torch.isfinite(top)
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    if kk < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - kk), value=-1)
        top = torch.nn.functional.pad(top, (0, topk - kk), value=float("-inf"))
    return idx, top


def kernel(q, k, w, doc_ids, topk):
    """q [B, L, Hi, Di], k [B, L, Di], w [B, L, Hi], doc_ids [B, L] -> (indices, scores)."""
    B, L = doc_ids.shape
    C = CONFIG["chunk"] if CONFIG["algo"] == "chunked" else L
    idx_rows, top_rows = [], []
    for b in range(B):
        parts = [_chunk(q[b], k[b], w[b], doc_ids[b], t0, min(L, t0 + C), topk)
                 for t0 in range(0, L, C)]  # fmt: skip
        idx_rows.append(torch.cat([p[0] for p in parts]))
        top_rows.append(torch.cat([p[1] for p in parts]))
    return torch.stack(idx_rows), torch.stack(top_rows)
