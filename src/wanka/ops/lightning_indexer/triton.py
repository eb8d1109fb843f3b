"""Lightning indexer in Triton for CUDA: chunked scores + top-k forward, sparse backward.

Same contract and result as `reference.lightning_indexer` (and the CPU backend):

* forward, per batch row and per chunk of C queries [t0, t1): a Triton kernel writes the
  chunk's score tile [C, span] over the keys the chunk can see, from the document start of
  query t0 to t1 - 1: score(t, s) = sum_j w(t, j) * ReLU(q(t, j) . k(s)), -inf where the key
  is in the future or in an earlier document. One program per (block of BLOCK_M queries,
  block of BLOCK_N keys) loops over the Hi index heads with one `tl.dot` each. torch then
  takes the top-k of the tile with the reference's tie rule (among equal scores the most
  recent key wins; `cpu._select_topk`). The tile is the only O(L) intermediate: peak extra
  memory is O(C * L), never [L, L]; C defaults to as many rows as fit CHUNK_ELEMS.
* backward (the gradients the KL loss needs, w.r.t. q, k and w through the selected
  scores): one program per (batch, query) walks the query's K selected slots in tiles of
  BLOCK_K, gathers the selected key rows by pointer arithmetic (-1 slots masked), recomputes
  the dots of all Hi heads at once ([Hi, Di] x [Di, BLOCK_K]), writes dq and dw directly
  and accumulates dk into a float32 buffer with atomic adds (several queries select the same
  key), so dk may differ at the last bit from run to run on a GPU. ReLU'(x) = (x > 0), as
  torch's.

Heads, head dim and tiles are padded to powers of two >= 16 (masked) so every product is a
`tl.dot`; float32 inputs use IEEE-precision dots, 16-bit inputs are upcast to float32 and
use TF32. doc_ids rows must be non-decreasing (packed documents are contiguous runs).

Queries may be a suffix of the keys (q / w [B, Lq, ...], k / doc_ids [B, Lk], query i at key
position OFF + i with OFF = Lk - Lq; `wanka.ops.registry` docstring): the score kernel works
in key positions and reads query rows at position - OFF; the backward only follows indices.

Triton is optional: without it this module registers an unavailable backend and defines no
kernels. Tests run the kernels on CPU tensors with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.dense_attention.cpu import check_doc_ids
from wanka.ops.dense_attention.reference import query_offset
from wanka.ops.lightning_indexer.cpu import _doc_starts, _new_index_output, _select_topk
from wanka.ops.registry import register
from wanka.ops.triton_common import HAVE_TRITON, dot_precision, pow2, tl, triton

# Elements of one chunk's float32 score tile [C, span] (span <= L).
CHUNK_ELEMS = 1 << 24

if HAVE_TRITON:

    @triton.jit
    def _scores_kernel(
        Q, Kp, W, START, OUT,
        sql, sqh, sqd, skl, skd, swl, swh, som, son,
        t0, s0, t1, HI, DI,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PREC: tl.constexpr, OFF=0,
    ):  # fmt: skip
        mb = tl.program_id(0)
        nb = tl.program_id(1)
        offs_m = t0 + mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query positions
        offs_n = s0 + nb * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions
        offs_d = tl.arange(0, BLOCK_D)
        mm = offs_m < t1
        nm = offs_n < t1
        dm = offs_d < DI
        kt = tl.load(
            Kp + offs_n[:, None] * skl + offs_d[None, :] * skd,
            mask=nm[:, None] & dm[None, :],
            other=0.0,
        ).to(tl.float32)  # [BN, BD]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        q_rows = Q + (offs_m - OFF)[:, None] * sql + offs_d[None, :] * sqd  # query index
        w_rows = W + (offs_m - OFF) * swl
        for h in range(0, HI):
            qh = tl.load(q_rows + h * sqh, mask=mm[:, None] & dm[None, :], other=0.0)
            wh = tl.load(w_rows + h * swh, mask=mm, other=0.0).to(tl.float32)
            d = tl.dot(qh.to(tl.float32), tl.trans(kt), input_precision=PREC)  # [BM, BN]
            acc += wh[:, None] * tl.maximum(d, 0.0)
        start = tl.load(START + offs_m, mask=mm, other=0)
        visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= start[:, None])
        acc = tl.where(visible, acc, float("-inf"))
        tl.store(
            OUT + (offs_m - t0)[:, None] * som + (offs_n - s0)[None, :] * son,
            acc,
            mask=mm[:, None] & nm[None, :],
        )

    @triton.jit
    def _bwd_kernel(
        Q, Kp, W, IDX, G, DQ, DK, DW,
        sqb, sql, sqh, sqd, skb, skl, skd, swb, swl, swh, sib, sil, sgb, sgl,
        sdqb, sdql, sdqh, sdqd, sdkb, sdkl, sdkd, sdwb, sdwl, sdwh,
        L, HI, DI, KSEL,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = (pid // L).to(tl.int64)
        t = (pid % L).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        hm = offs_h < HI
        dm = offs_d < DI
        qmask = hm[:, None] & dm[None, :]
        q = tl.load(
            Q + b * sqb + t * sql + offs_h[:, None] * sqh + offs_d[None, :] * sqd,
            mask=qmask,
            other=0.0,
        ).to(tl.float32)  # [BH, BD]
        w = tl.load(W + b * swb + t * swl + offs_h * swh, mask=hm, other=0.0).to(tl.float32)
        dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        dw = tl.zeros([BLOCK_H], tl.float32)
        for k0 in range(0, KSEL, BLOCK_K):
            kk = k0 + offs_k
            km = kk < KSEL
            idx = tl.load(IDX + b * sib + t * sil + kk, mask=km, other=-1)
            valid = idx >= 0
            safe = tl.where(valid, idx, 0).to(tl.int64)
            g = tl.load(G + b * sgb + t * sgl + kk, mask=km & valid, other=0.0).to(tl.float32)
            g = tl.where(valid, g, 0.0)  # empty slots carry no gradient
            m2 = valid[:, None] & dm[None, :]
            kt = tl.load(
                Kp + b * skb + safe[:, None] * skl + offs_d[None, :] * skd, mask=m2, other=0.0
            ).to(tl.float32)  # [BK, BD]
            dots = tl.dot(q, tl.trans(kt), input_precision=PREC)  # [BH, BK]
            dw += tl.sum(tl.maximum(dots, 0.0) * g[None, :], 1)
            dr = tl.where(dots > 0.0, w[:, None] * g[None, :], 0.0)  # [BH, BK]
            dq += tl.dot(dr, kt, input_precision=PREC)
            dk_t = tl.dot(tl.trans(dr), q, input_precision=PREC)  # [BK, BD]
            tl.atomic_add(
                DK + b * sdkb + safe[:, None] * sdkl + offs_d[None, :] * sdkd, dk_t, mask=m2
            )
        tl.store(
            DQ + b * sdqb + t * sdql + offs_h[:, None] * sdqh + offs_d[None, :] * sdqd,
            dq.to(DQ.dtype.element_ty),
            mask=qmask,
        )
        tl.store(DW + b * sdwb + t * sdwl + offs_h * sdwh, dw.to(DW.dtype.element_ty), mask=hm)


def _chunk_rows(L: int, Lk: int, chunk_size: int | None) -> int:
    """Queries per chunk: chunk_size, else as many as keep a [C, Lk] tile under CHUNK_ELEMS."""
    if chunk_size is not None:
        return max(1, min(int(chunk_size), L))
    return max(1, min(L, CHUNK_ELEMS // max(1, Lk)))


def _score_tile(q, k, w, starts, t0, s0, t1, block):
    """Score tile [t1 - t0, t1 - s0] float32 of one batch row (q [Lq, Hi, Di], k [Lk, Di],
    w [Lq, Hi], starts [Lk]) for the queries at key positions t0 .. t1 - 1 (query index =
    position - (Lk - Lq)). Module-level: tests spy on the tile shapes to check that nothing
    bigger than a chunk is ever scored."""
    n, span = t1 - t0, t1 - s0
    tile = torch.empty(n, span, dtype=torch.float32, device=q.device)
    Di = q.shape[-1]
    bm = bn = pow2(min(block or 32, 64))
    grid = (triton.cdiv(n, bm), triton.cdiv(span, bn))
    _scores_kernel[grid](
        q, k, w, starts, tile,
        *q.stride(), *k.stride(), *w.stride(), *tile.stride(),
        t0, s0, t1, q.shape[1], Di,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=pow2(Di), PREC=dot_precision(q.dtype),
        OFF=k.shape[0] - q.shape[0],
    )  # fmt: skip
    return tile


def _forward(q, k, w, doc_ids, topk, chunk_size, block):
    B, L, Hi, Di = q.shape
    off = query_offset(L, k.shape[1])  # key position of query 0
    starts = _doc_starts(doc_ids).contiguous()
    idx_out = _new_index_output((B, L, topk), q.device)
    val_out = new_output((B, L, topk), q.dtype, q.device)
    C = _chunk_rows(L, k.shape[1], chunk_size)
    ninf = float("-inf")
    starts_cpu = starts.cpu()
    for b in range(B):
        st = starts_cpu[b].tolist()
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            p0, p1 = off + t0, off + t1  # key positions of the chunk's queries
            s0 = st[p0]
            sc = _score_tile(q[b], k[b], w[b], starts[b], p0, s0, p1, block)
            kc = min(topk, p1 - s0)
            vals, idx = _select_topk(sc, kc)
            idx += s0
            idx.masked_fill_(vals == ninf, -1)
            idx_out[b, t0:t1, :kc] = idx
            val_out[b, t0:t1, :kc] = vals.to(q.dtype)
            if kc < topk:
                idx_out[b, t0:t1, kc:] = -1
                val_out[b, t0:t1, kc:] = ninf
    return idx_out, val_out


def _backward(q, k, w, idx, g_val, block_k):
    B, L, Hi, Di = q.shape
    K = idx.shape[-1]
    dq = new_output(q.shape, q.dtype, q.device)
    dw = new_output(w.shape, w.dtype, w.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # accumulated
    if B * L == 0 or K == 0:
        return dq.zero_(), dk.to(k.dtype), dw.zero_()
    g_val = g_val.contiguous()
    bk = pow2(min(K, 32)) if block_k is None else pow2(block_k)
    _bwd_kernel[(B * L,)](
        q, k, w, idx, g_val, dq, dk, dw,
        *q.stride(), *k.stride(), *w.stride(), idx.stride(0), idx.stride(1),
        g_val.stride(0), g_val.stride(1),
        *dq.stride(), *dk.stride(), *dw.stride(),
        L, Hi, Di, K,
        BLOCK_H=pow2(Hi), BLOCK_D=pow2(Di), BLOCK_K=bk, PREC=dot_precision(q.dtype),
    )  # fmt: skip
    return dq, dk.to(k.dtype), dw


class _TritonIndexer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, doc_ids, topk, chunk_size, block):
        idx, val = _forward(q, k, w, doc_ids, topk, chunk_size, block)
        ctx.save_for_backward(q, k, w, idx)
        ctx.block = block
        ctx.mark_non_differentiable(idx)
        return idx, val

    @staticmethod
    @once_differentiable
    def backward(ctx, _g_idx, g_val):
        q, k, w, idx = ctx.saved_tensors
        dq, dk, dw = _backward(q, k, w, idx, g_val, ctx.block)
        needs = ctx.needs_input_grad
        return (
            dq if needs[0] else None,
            dk if needs[1] else None,
            dw if needs[2] else None,
            None,
            None,
            None,
            None,
        )


@register(
    "lightning_indexer",
    "triton",
    device_types=("cuda",),
    priority=20,
    available=lambda: HAVE_TRITON,
)
def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    doc_ids: torch.Tensor,
    topk: int,
    *,
    chunk_size: int | None = None,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Lq, Hi, Di], k [B, Lk, Di], w [B, Lq, Hi], doc_ids [B, Lk] (rows
    non-decreasing; Lq <= Lk: the queries are the last Lq key positions) -> (indices
    [B, Lq, topk] int64 key positions with -1 in empty slots, scores [B, Lq, topk] with -inf
    in empty slots, differentiable w.r.t. q, k, w). `chunk_size` queries are scored at a time;
    `block` sets the kernels' tile sizes (rounded up to powers of two >= 16; tests/tuning)."""
    if not HAVE_TRITON:
        raise RuntimeError("the triton lightning_indexer backend needs the triton package")
    check_doc_ids(doc_ids)
    return _TritonIndexer.apply(q, k, w, doc_ids, int(topk), chunk_size, block)
