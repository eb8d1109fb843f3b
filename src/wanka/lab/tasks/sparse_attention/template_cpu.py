"""Sparse attention (MQA over top-k indices) on CPU: one point of the lab's variant space.

The search proposer rewrites the CONFIG line; every combination is exact (up to float
rounding, except the bfloat16 score GEMMs, which the tolerance may reject):

- algo: "gather_full" gathers [L, K, D] keys/values per batch row (the reference's way);
  "gather" does the same per chunk of queries with batched matmuls; "union" scores each
  chunk against the union of its selected key columns with one GEMM and a [c, u] mask
  (windowed patterns share most columns); "hybrid" sends a column to that dense GEMM only
  when at least chunk/divisor queries select it and gathers the rest.
- chunk: queries per chunk (cache footprint vs GEMM size).
- backward: "recompute" saves only the log-sum-exp and recomputes probabilities per chunk
  (FlashAttention-2 style, dK/dV by index_add_); "autograd" keeps every chunk's graph.
- take: how key/value rows are gathered. dtype: precision of the score/value GEMMs.
- scale_at: fold the softmax scale into q (one [c, H, D] multiply) or into the scores.
"""

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

CONFIG = {"algo": "gather_full", "chunk": 64, "divisor": 1.5, "backward": "recompute", "take": "index_select", "dtype": "float32", "scale_at": "q"}  # fmt: skip

NEG_INF = float("-inf")


def _take(x, idx):
    """x [N, D], idx int64 [...] (>= 0) -> [..., D]."""
    how = CONFIG["take"]
    if how == "index_select":
        return x.index_select(0, idx.reshape(-1)).view(*idx.shape, x.shape[-1])
    if how == "embedding":
        return F.embedding(idx, x)
    return x[idx]


def _gemm_dtype():
    return torch.bfloat16 if CONFIG["dtype"] == "bfloat16" else torch.float32


def _plan(idx):
    """Split one chunk's selections idx [c, K] into a dense part (columns dcols [u], mask
    [c, u]) and a gather part (ridx [c, kr] compacted, rvalid [c, kr]); None when absent."""
    valid = idx >= 0
    if CONFIG["algo"] == "gather":
        return None, None, idx.clamp(min=0), valid
    c = idx.shape[0]
    cols, inv = torch.unique(idx, return_inverse=True)  # sorted; -1 (empty slot) first
    keep = cols >= 0
    if CONFIG["algo"] == "hybrid":
        counts = torch.bincount(inv.view(-1), minlength=cols.numel())
        keep &= counts >= max(2, math.ceil(c / CONFIG["divisor"]))
    u = int(keep.sum())
    pos = (torch.cumsum(keep, 0) - 1).masked_fill_(~keep, -1)[inv]  # [c, K] dense column
    dense = pos >= 0
    dcols = dmask = None
    if u > 0:
        dcols = cols[keep]
        dmask = torch.zeros(c, u + 1, dtype=torch.bool)
        dmask.scatter_(1, pos.masked_fill(~dense, u), True)
        dmask = dmask[:, :u]
    rare = valid & ~dense
    kr = int(rare.sum(1).max()) if rare.any() else 0
    if kr == 0:
        return dcols, dmask, None, None
    dest = (rare.cumsum(1) - 1).masked_fill_(~rare, kr)
    ridx = torch.full((c, kr + 1), -1, dtype=torch.long).scatter_(1, dest, idx)[:, :kr]
    return dcols, dmask, ridx.clamp(min=0), ridx >= 0


def _scores(q_c, kb, plan, scale):
    """q_c [c, H, D] -> (dense scores [c, H, u] | None, gather scores [c, H, kr] | None,
    dense rows [u, D], gathered rows [c, kr, D]), float32, masked with -inf."""
    dcols, dmask, ridx, rvalid = plan
    c, H, D = q_c.shape
    g = _gemm_dtype()
    qs = (q_c * scale if CONFIG["scale_at"] == "q" else q_c).to(g)
    sd = sr = kd = kg = None
    if dcols is not None:
        kd = _take(kb, dcols)
        sd = torch.mm(qs.reshape(c * H, D), kd.to(g).t()).view(c, H, -1).float()
        if CONFIG["scale_at"] == "scores":
            sd = sd * scale
        sd = sd.masked_fill(~dmask[:, None, :], NEG_INF)
    if ridx is not None:
        kg = _take(kb, ridx)
        sr = torch.bmm(qs, kg.to(g).transpose(1, 2)).float()
        if CONFIG["scale_at"] == "scores":
            sr = sr * scale
        sr = sr.masked_fill(~rvalid[:, None, :], NEG_INF)
    return sd, sr, kd, kg


def _attend_chunk(q_c, kb, vb, plan, scale):
    """-> (out [c, H, D], lse [c, H]); differentiable when autograd is on."""
    c, H, D = q_c.shape
    g = _gemm_dtype()
    sd, sr, _, _ = _scores(q_c, kb, plan, scale)
    parts = [s for s in (sd, sr) if s is not None]
    m = torch.stack([s.amax(-1) for s in parts]).amax(0).detach()[..., None]  # [c, H, 1]
    total = 0.0
    o = 0.0
    if sd is not None:
        p = torch.exp(sd - m)
        total = total + p.sum(-1)
        vd = _take(vb, plan[0]).to(g)
        o = o + torch.mm(p.reshape(c * H, -1).to(g), vd).view(c, H, D).float()
    if sr is not None:
        p = torch.exp(sr - m)
        total = total + p.sum(-1)
        o = o + torch.bmm(p.to(g), _take(vb, plan[2]).to(g)).float()
    return o / total[..., None], m[..., 0] + torch.log(total)


def _gather_full(q, k, v, indices, scale):
    outs = []
    g = _gemm_dtype()
    for b in range(q.shape[0]):
        idx = indices[b]
        ks, vs = _take(k[b], idx.clamp(min=0)), _take(v[b], idx.clamp(min=0))
        qs = (q[b] * scale if CONFIG["scale_at"] == "q" else q[b]).to(g)
        s = torch.einsum("lhd,lkd->lhk", qs, ks.to(g)).float()
        if CONFIG["scale_at"] == "scores":
            s = s * scale
        s = s.masked_fill((idx < 0)[:, None, :], NEG_INF)
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("lhk,lkd->lhd", p.to(g), vs.to(g)).float())
    return torch.stack(outs).to(q.dtype)


def _chunked_autograd(q, k, v, indices, scale):
    C = CONFIG["chunk"]
    rows = []
    for b in range(q.shape[0]):
        pieces = []
        for t0 in range(0, q.shape[1], C):
            plan = _plan(indices[b, t0 : t0 + C])
            pieces.append(_attend_chunk(q[b, t0 : t0 + C], k[b], v[b], plan, scale)[0])
        rows.append(torch.cat(pieces))
    return torch.stack(rows).to(q.dtype)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale):
        B, L, H, D = q.shape
        C = CONFIG["chunk"]
        out = torch.empty(B, L, H, D, dtype=q.dtype)
        lse = torch.empty(B, L, H)
        for b in range(B):
            for t0 in range(0, L, C):
                plan = _plan(indices[b, t0 : t0 + C])
                o, ls = _attend_chunk(q[b, t0 : t0 + C], k[b], v[b], plan, scale)
                out[b, t0 : t0 + C] = o
                lse[b, t0 : t0 + C] = ls
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, indices, out, lse = ctx.saved_tensors
        scale = ctx.scale
        B, L, H, D = q.shape
        C = CONFIG["chunk"]
        dq = torch.empty_like(q)
        dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
        for b in range(B):
            for t0 in range(0, L, C):
                plan = _plan(indices[b, t0 : t0 + C])
                dcols, _, ridx, _ = plan
                q_c, do = q[b, t0 : t0 + C].float(), dout[b, t0 : t0 + C].float()
                c = q_c.shape[0]
                qs = q_c * scale
                ls = lse[b, t0 : t0 + C][..., None]
                delta = (do * out[b, t0 : t0 + C].float()).sum(-1, keepdim=True)
                sd, sr, kd, kg = _scores(q_c, k[b], plan, scale)
                dqc = torch.zeros_like(qs)
                if sd is not None:
                    p = torch.exp(sd - ls).view(c * H, -1)
                    ds = torch.mm(do.view(c * H, D), _take(v[b], dcols).t()).view(c, H, -1)
                    ds = ((ds - delta) * p.view(c, H, -1)).view(c * H, -1)
                    dqc += torch.mm(ds, kd).view(c, H, D)
                    dk[b].index_add_(0, dcols, torch.mm(ds.t(), qs.reshape(c * H, D)))
                    dv[b].index_add_(0, dcols, torch.mm(p.t(), do.reshape(c * H, D)))
                if sr is not None:
                    p = torch.exp(sr - ls)
                    ds = (torch.bmm(do, _take(v[b], ridx).transpose(1, 2)) - delta) * p
                    dqc += torch.bmm(ds, kg)
                    flat = ridx.reshape(-1)  # empty slots have p = ds = 0: adding 0 is harmless
                    dk[b].index_add_(0, flat, torch.bmm(ds.transpose(1, 2), qs).view(-1, D))
                    dv[b].index_add_(0, flat, torch.bmm(p.transpose(1, 2), do).view(-1, D))
                dq[b, t0 : t0 + C] = dqc * scale
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def kernel(q, k, v, indices, scale):
    """q [B, L, H, D]; k, v [B, L, D]; indices [B, L, K] int64 (-1 = empty) -> [B, L, H, D]."""
    if CONFIG["algo"] == "gather_full":
        return _gather_full(q, k, v, indices, scale)
    if CONFIG["backward"] == "autograd" or not torch.is_grad_enabled():
        return _chunked_autograd(q, k, v, indices, scale)
    return _Recompute.apply(q, k, v, indices, float(scale))
