"""DSA sparse attention (MQA, top-k indices) on CPU: chunked, exact, with its own backward.

Same math as `reference.sparse_attention`, but it never materialises the gathered
[B, L, K, D] keys/values: queries are processed one chunk of C at a time, forward and
backward (FlashAttention-2 style: the forward saves only q, k, v, indices, out and the
log-sum-exp [B, L, H]; the backward recomputes the probabilities chunk by chunk,
dS = P * (dP - rowsum(dO * O)), and accumulates dK/dV with index_add_).

Each chunk splits the key columns it uses into two exact parts (one softmax over both):

- dense ("union") part: key columns selected by many queries of the chunk. Their rows
  K[U] [u, D] are gathered once and scored with one GEMM [C*H, D] x [D, u]; each query is
  masked to its own selection by a [C, u] boolean mask. Windowed / heavy-hitter patterns
  put nearly everything here: big GEMMs instead of C tiny ones, and u ~ K + C rows of K/V
  read instead of C * K.
- gather part: the remaining (rare) selections, compacted to [C, Kr] and computed with
  batched matmuls over gathered rows [C, Kr, D] ([C, H, D] x [C, D, Kr]). Works for any
  pattern; random indices land here entirely.

`strategy="auto"` sends a key column to the dense part when at least C / DENSE_DIVISOR of
the chunk's queries select it (dense costs C score rows per column, gather one per use at a
worse rate); "union" sends every column there, "gather" none (both for tests/benchmarks).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.registry import register

STRATEGIES = ("auto", "gather", "union")
DEFAULT_CHUNK = 128
DENSE_DIVISOR = 1.5
# The gathered [C, Kr, D] keys (and values) of one chunk stay under this many elements.
GATHER_BUDGET = 1 << 22


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [N, D], idx int64 [...] (all >= 0) -> [..., D]. Every K/V row gather goes through
    here (tests patch it to check that no gather spans more than one chunk)."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, x.shape[-1])


def _chunk_size(K: int, D: int, chunk: int | None) -> int:
    if chunk is not None:
        return max(1, int(chunk))
    return max(16, min(DEFAULT_CHUNK, GATHER_BUDGET // max(1, K * D)))


def _min_count(strategy: str, C: int) -> int | None:
    """Least number of the chunk's queries selecting a column for it to go dense."""
    if strategy == "gather":
        return None
    if strategy == "union":
        return 1
    if strategy == "auto":
        return max(2, math.ceil(C / DENSE_DIVISOR))
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


class _Plan:
    """How one chunk's selections [C, K] split into the dense and gather parts."""

    __slots__ = ("dcols", "dmask", "ridx", "rvalid")

    def __init__(self, idx: torch.Tensor, min_count: int | None):
        valid = idx >= 0
        self.dcols = self.dmask = None
        if min_count is None:
            self.ridx, self.rvalid = idx.clamp(min=0), valid
            return
        C, K = idx.shape
        safe = idx.clamp(min=0)
        lo = int(safe.masked_fill(~valid, idx.max()).min())
        n = int(safe.max()) - lo + 1
        rel = (safe - lo).masked_fill_(~valid, n)  # invalid -> dummy bin n
        counts = torch.bincount(rel.view(-1), minlength=n + 1)
        counts[n] = 0
        dense_col = counts >= min_count  # [n + 1]
        colpos = dense_col.cumsum(0).sub_(1).masked_fill_(~dense_col, -1)
        pos = colpos[rel]  # [C, K]: column of each selection in the dense part, -1 if none
        is_dense = pos >= 0
        u = int(dense_col.sum())
        if u > 0:
            self.dcols = dense_col.nonzero().view(-1).add_(lo)
            mask = torch.zeros(C, u + 1, dtype=torch.bool)
            mask.scatter_(1, pos.masked_fill(~is_dense, u), True)
            self.dmask = mask[:, :u]
        rare = valid & ~is_dense
        kr = int(rare.sum(1).max()) if rare.numel() else 0
        if kr == 0:
            self.ridx = self.rvalid = None
        elif u == 0:
            self.ridx, self.rvalid = safe, valid
        else:  # compact each row's rare selections to the front of [C, kr]
            dest = rare.cumsum(1).sub_(1).masked_fill_(~rare, kr)
            ridx = torch.full((C, kr + 1), -1, dtype=torch.long)
            ridx.scatter_(1, dest, idx)
            ridx = ridx[:, :kr]
            self.rvalid = ridx >= 0
            self.ridx = ridx.clamp(min=0)


def _scores(qs, kb, plan: _Plan):
    """qs [C, H, D] (scaled queries) -> masked scores (dense [C, H, u], gather [C, H, kr],
    each None when absent) and the rows used (Kd [u, D], Kg [C, kr, D])."""
    C, H, D = qs.shape
    sd = sr = kd = kg = None
    if plan.dcols is not None:
        kd = _rows(kb, plan.dcols)
        sd = torch.mm(qs.reshape(C * H, D), kd.t()).view(C, H, -1)
        sd.masked_fill_(~plan.dmask[:, None, :], float("-inf"))
    if plan.ridx is not None:
        kg = _rows(kb, plan.ridx)
        sr = torch.bmm(qs, kg.transpose(1, 2))
        sr.masked_fill_(~plan.rvalid[:, None, :], float("-inf"))
    return sd, sr, kd, kg


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _forward(q, k, v, indices, scale, strategy, chunk):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    cdt = _compute_dtype(q.dtype)
    out = new_output((B, L, H, D), q.dtype, q.device)
    lse = new_output((B, L, H), torch.float32, q.device)
    C = _chunk_size(K, D, chunk)
    for b in range(B):
        kb, vb = k[b].to(cdt).contiguous(), v[b].to(cdt).contiguous()
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            plan = _Plan(indices[b, t0:t1], _min_count(strategy, t1 - t0))
            qs = q[b, t0:t1].to(cdt) * scale
            sd, sr, _, _ = _scores(qs, kb, plan)
            m = torch.stack([s.amax(-1) for s in (sd, sr) if s is not None]).amax(
                0
            )  # [C, H], finite: each row has a valid index
            total = torch.zeros_like(m)
            o = torch.zeros_like(qs)
            c, h = qs.shape[:2]
            if sd is not None:
                pd = sd.sub_(m[..., None]).exp_()
                total += pd.sum(-1)
                o += torch.mm(pd.view(c * h, -1), _rows(vb, plan.dcols)).view(c, h, D)
            if sr is not None:
                pr = sr.sub_(m[..., None]).exp_()
                total += pr.sum(-1)
                o += torch.bmm(pr, _rows(vb, plan.ridx))
            out[b, t0:t1] = (o / total[..., None]).to(q.dtype)
            lse[b, t0:t1] = (m + total.log()).float()
    return out, lse


def _backward(q, k, v, indices, out, lse, dout, scale, strategy, chunk, needs):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    cdt = _compute_dtype(q.dtype)
    dq = new_output((B, L, H, D), q.dtype, q.device) if needs[0] else None
    # dK/dV are accumulated (index_add_), so they start from zeros, not new_output.
    dk = torch.zeros(k.shape, dtype=cdt) if needs[1] else None
    dv = torch.zeros(v.shape, dtype=cdt) if needs[2] else None
    C = _chunk_size(K, D, chunk)
    for b in range(B):
        kb, vb = k[b].to(cdt).contiguous(), v[b].to(cdt).contiguous()
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            c = t1 - t0
            plan = _Plan(indices[b, t0:t1], _min_count(strategy, c))
            qs = q[b, t0:t1].to(cdt) * scale
            do = dout[b, t0:t1].to(cdt)
            lse_c = lse[b, t0:t1].to(cdt)[..., None]
            delta = (do * out[b, t0:t1].to(cdt)).sum(-1, keepdim=True)  # [C, H, 1]
            sd, sr, kd, kg = _scores(qs, kb, plan)
            dqc = torch.zeros_like(qs) if dq is not None else None
            do2 = do.reshape(c * H, D)
            if sd is not None:
                pd = sd.sub_(lse_c).exp_().view(c * H, -1)  # [C*H, u]
                vd = _rows(vb, plan.dcols)
                ds = torch.mm(do2, vd.t()).sub_(delta.view(c * H, 1)).mul_(pd)
                if dqc is not None:
                    dqc += torch.mm(ds, kd).view(c, H, D)
                if dk is not None:
                    dk[b].index_add_(0, plan.dcols, torch.mm(ds.t(), qs.reshape(c * H, D)))
                if dv is not None:
                    dv[b].index_add_(0, plan.dcols, torch.mm(pd.t(), do2))
            if sr is not None:
                pr = sr.sub_(lse_c).exp_()  # [C, H, kr]
                vg = _rows(vb, plan.ridx)
                ds = torch.bmm(do, vg.transpose(1, 2)).sub_(delta).mul_(pr)
                flat = plan.ridx.reshape(-1)  # invalid slots have P = dS = 0: adding 0 is harmless
                if dqc is not None:
                    dqc += torch.bmm(ds, kg)
                if dk is not None:
                    dk[b].index_add_(0, flat, torch.bmm(ds.transpose(1, 2), qs).view(-1, D))
                if dv is not None:
                    dv[b].index_add_(0, flat, torch.bmm(pr.transpose(1, 2), do).view(-1, D))
            if dq is not None:
                dq[b, t0:t1] = (dqc * scale).to(q.dtype)
    dk = dk.to(k.dtype) if dk is not None else None
    dv = dv.to(v.dtype) if dv is not None else None
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, strategy, chunk):
        out, lse = _forward(q, k, v, indices, scale, strategy, chunk)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.cfg = (scale, strategy, chunk)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, indices, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        dq, dk, dv = _backward(q, k, v, indices, out, lse, dout, *ctx.cfg, needs)
        return dq, dk, dv, None, None, None, None


@register("sparse_attention", "cpu", device_types=("cpu",), priority=10)
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    strategy: str = "auto",
    chunk: int | None = None,
) -> torch.Tensor:
    """q [B, L, H, D]; k, v [B, L, D]; indices [B, L, K] int64 (-1 = empty) -> [B, L, H, D].

    Same contract and result as the reference. `strategy` ("auto" | "gather" | "union")
    and `chunk` (queries per chunk; default from K and D) are for tests and tuning.
    """
    _min_count(strategy, 1)  # validate early
    return _SparseAttention.apply(q, k, v, indices, float(scale), strategy, chunk)
