"""Dense causal MQA attention with document masking in Triton for CUDA: forward and backward.

Same contract and result as `reference.dense_attention`. FlashAttention-2 style:

* forward: one program per (query block of BLOCK_M tokens, batch, head). It walks the key
  blocks from the document start of the block's first query to the block's last query
  (blocks outside the causal / same-document band are skipped, partial ones are masked),
  keeps an online softmax and writes O and the log-sum-exp [B, H, L];
* backward: delta = rowsum(dO * O) in torch; one kernel computes dQ per (query block, batch,
  head) over the same key range; another computes dK/dV per (key block, batch), looping over
  all H heads (the single KV head is shared) and over the query blocks from the key block to
  the document end of its last key, so no atomics are needed (deterministic).

Sequence tiles are BLOCK_M = BLOCK_N = 16..64 and the head dim is padded to a power of two
>= 16 (masked) so every product is a `tl.dot`. float32 inputs use IEEE-precision dots; 16-bit
inputs are upcast to float32 and use TF32.

doc_ids rows must be non-decreasing (packed documents are contiguous runs); this is checked.

Queries may be a suffix of the keys (q [B, Lq, ...], k / v / doc_ids [B, Lk], query i at key
position OFF + i with OFF = Lk - Lq; `wanka.ops.registry` docstring): the kernels take the
query count L and OFF (default 0), index queries, O, the log-sum-exp and dQ by query index
and compare key positions with OFF + query index.

Triton is optional: without it this module registers an unavailable backend and defines
no kernels. Tests run the kernels on CPU tensors with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.dense_attention.cpu import check_doc_ids
from wanka.ops.dense_attention.reference import query_offset
from wanka.ops.registry import register
from wanka.ops.triton_common import HAVE_TRITON, dot_precision, pow2, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _fwd_kernel(
        Q, Kp, Vp, DOC, START, OUT, LSE, scale,
        sqb, sql, sqh, sqd, skb, skl, skd, svb, svl, svd,
        sob, sol, soh, sod,
        L, H, D,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PREC: tl.constexpr, OFF=0,
    ):  # fmt: skip
        mb = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        m0 = mb * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mm = offs_m < L
        dm = offs_d < D
        qmask = mm[:, None] & dm[None, :]
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
            mask=qmask,
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        LK = L + OFF  # keys; query i sits at key position OFF + i
        pos_m = OFF + offs_m
        doc_q = tl.load(DOC + b * LK + pos_m, mask=mm, other=-1)
        lo = tl.load(START + b * LK + OFF + m0)
        lo = (lo // BLOCK_N) * BLOCK_N
        hi = tl.minimum(OFF + m0 + BLOCK_M, LK)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        lsum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_n0
            nm = offs_n < LK
            kvm = nm[:, None] & dm[None, :]
            kt = tl.load(
                Kp + b * skb + offs_n[:, None] * skl + offs_d[None, :] * skd, mask=kvm, other=0.0
            ).to(tl.float32)
            vt = tl.load(
                Vp + b * svb + offs_n[:, None] * svl + offs_d[None, :] * svd, mask=kvm, other=0.0
            ).to(tl.float32)
            doc_k = tl.load(DOC + b * LK + offs_n, mask=nm, other=-2)
            valid = (
                (offs_n[None, :] <= pos_m[:, None])
                & (doc_k[None, :] == doc_q[:, None])
                & nm[None, :]
                & mm[:, None]
            )
            s = tl.dot(q, tl.trans(kt), input_precision=PREC)  # [BM, BN]
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PREC)
            m = m_new
        lsum = tl.where(lsum > 0, lsum, 1.0)  # padded rows only: every query sees itself
        out = acc / lsum[:, None]
        lse = m + tl.log(lsum)
        tl.store(
            OUT + b * sob + h * soh + offs_m[:, None] * sol + offs_d[None, :] * sod,
            out.to(OUT.dtype.element_ty),
            mask=qmask,
        )
        tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=mm)

    @triton.jit
    def _bwd_dq_kernel(
        Q, Kp, Vp, DOC, START, DO, LSE, DELTA, DQ, scale,
        sqb, sql, sqh, sqd, skb, skl, skd, svb, svl, svd,
        sdob, sdol, sdoh, sdod, sdqb, sdql, sdqh, sdqd,
        L, H, D,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PREC: tl.constexpr, OFF=0,
    ):  # fmt: skip
        mb = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        m0 = mb * BLOCK_M
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n0 = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        mm = offs_m < L
        dm = offs_d < D
        qmask = mm[:, None] & dm[None, :]
        q = tl.load(
            Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
            mask=qmask,
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        do = tl.load(
            DO + b * sdob + h * sdoh + offs_m[:, None] * sdol + offs_d[None, :] * sdod,
            mask=qmask,
            other=0.0,
        ).to(tl.float32)
        lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=mm, other=0.0)
        delta = tl.load(DELTA + bh.to(tl.int64) * L + offs_m, mask=mm, other=0.0)
        LK = L + OFF  # keys; query i sits at key position OFF + i
        pos_m = OFF + offs_m
        doc_q = tl.load(DOC + b * LK + pos_m, mask=mm, other=-1)
        lo = tl.load(START + b * LK + OFF + m0)
        lo = (lo // BLOCK_N) * BLOCK_N
        hi = tl.minimum(OFF + m0 + BLOCK_M, LK)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_n0
            nm = offs_n < LK
            kvm = nm[:, None] & dm[None, :]
            kt = tl.load(
                Kp + b * skb + offs_n[:, None] * skl + offs_d[None, :] * skd, mask=kvm, other=0.0
            ).to(tl.float32)
            vt = tl.load(
                Vp + b * svb + offs_n[:, None] * svl + offs_d[None, :] * svd, mask=kvm, other=0.0
            ).to(tl.float32)
            doc_k = tl.load(DOC + b * LK + offs_n, mask=nm, other=-2)
            valid = (
                (offs_n[None, :] <= pos_m[:, None])
                & (doc_k[None, :] == doc_q[:, None])
                & nm[None, :]
                & mm[:, None]
            )
            s = tl.dot(q, tl.trans(kt), input_precision=PREC)
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds, kt, input_precision=PREC)
        dq = dq * scale
        tl.store(
            DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdql + offs_d[None, :] * sdqd,
            dq.to(DQ.dtype.element_ty),
            mask=qmask,
        )

    @triton.jit
    def _bwd_dkdv_kernel(
        Q, Kp, Vp, DOC, END, DO, LSE, DELTA, DK, DV, scale,
        sqb, sql, sqh, sqd, skb, skl, skd, svb, svl, svd,
        sdob, sdol, sdoh, sdod, sdkb, sdkl, sdkd, sdvb, sdvl, sdvd,
        L, H, D,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        PREC: tl.constexpr, OFF=0,
    ):  # fmt: skip
        nb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        LK = L + OFF  # keys; query i sits at key position OFF + i
        n0 = nb * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_m0 = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        nm = offs_n < LK
        dm = offs_d < D
        kvm = nm[:, None] & dm[None, :]
        kt = tl.load(
            Kp + b * skb + offs_n[:, None] * skl + offs_d[None, :] * skd, mask=kvm, other=0.0
        ).to(tl.float32)
        vt = tl.load(
            Vp + b * svb + offs_n[:, None] * svl + offs_d[None, :] * svd, mask=kvm, other=0.0
        ).to(tl.float32)
        doc_k = tl.load(DOC + b * LK + offs_n, mask=nm, other=-2)
        last = tl.minimum(n0 + BLOCK_N, LK) - 1
        # query indices: from the first that may see key n0 to the last key's document end
        hi = tl.load(END + b * LK + last) - OFF
        lo = (tl.maximum(n0 - OFF, 0) // BLOCK_M) * BLOCK_M
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        for h in range(0, H):
            for m0 in range(lo, hi, BLOCK_M):
                offs_m = m0 + offs_m0
                mm = offs_m < L
                qmask = mm[:, None] & dm[None, :]
                q = tl.load(
                    Q + b * sqb + h * sqh + offs_m[:, None] * sql + offs_d[None, :] * sqd,
                    mask=qmask,
                    other=0.0,
                ).to(tl.float32)
                do = tl.load(
                    DO + b * sdob + h * sdoh + offs_m[:, None] * sdol + offs_d[None, :] * sdod,
                    mask=qmask,
                    other=0.0,
                ).to(tl.float32)
                row = (b * H + h) * L + offs_m
                lse = tl.load(LSE + row, mask=mm, other=0.0)
                delta = tl.load(DELTA + row, mask=mm, other=0.0)
                doc_q = tl.load(DOC + b * LK + OFF + offs_m, mask=mm, other=-1)
                valid = (
                    (offs_n[:, None] <= OFF + offs_m[None, :])
                    & (doc_k[:, None] == doc_q[None, :])
                    & nm[:, None]
                    & mm[None, :]
                )  # [BN, BM]
                st = tl.dot(kt, tl.trans(q), input_precision=PREC) * scale
                pt = tl.where(valid, tl.exp(st - lse[None, :]), 0.0)
                dv += tl.dot(pt, do, input_precision=PREC)
                dpt = tl.dot(vt, tl.trans(do), input_precision=PREC)
                dst = pt * (dpt - delta[None, :])
                dk += tl.dot(dst, q, input_precision=PREC)
        dk = dk * scale
        tl.store(
            DK + b * sdkb + offs_n[:, None] * sdkl + offs_d[None, :] * sdkd,
            dk.to(DK.dtype.element_ty),
            mask=kvm,
        )
        tl.store(
            DV + b * sdvb + offs_n[:, None] * sdvl + offs_d[None, :] * sdvd,
            dv.to(DV.dtype.element_ty),
            mask=kvm,
        )


def _blocks(L: int, D: int, block: int | None):
    """L: the number of keys (>= queries)."""
    bm = min(64, pow2(L)) if block is None else pow2(block)
    return bm, pow2(D)


def _doc_bounds(doc_ids: torch.Tensor):
    """int32 [B, L] each: the first index of each token's document and the (exclusive) end."""
    B, L = doc_ids.shape
    idx = torch.arange(L, device=doc_ids.device, dtype=torch.int32).expand(B, L)
    is_start = torch.ones(B, L, dtype=torch.bool, device=doc_ids.device)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(is_start, idx, 0).cummax(1).values
    is_end = torch.ones(B, L, dtype=torch.bool, device=doc_ids.device)
    is_end[:, :-1] = is_start[:, 1:]
    end = torch.where(is_end, idx + 1, L).flip(1).cummin(1).values.flip(1)
    return start.to(torch.int32).contiguous(), end.to(torch.int32).contiguous()


def _forward(q, k, v, doc, start, scale, block):
    B, L, H, D = q.shape
    off = k.shape[1] - L
    out = new_output((B, L, H, D), q.dtype, q.device)
    lse = new_output((B, H, L), torch.float32, q.device)
    if B * L * H == 0:
        return out, lse
    BM, BD = _blocks(k.shape[1], D, block)
    _fwd_kernel[(triton.cdiv(L, BM), B * H)](
        q, k, v, doc, start, out, lse, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        L, H, D,
        BLOCK_M=BM, BLOCK_N=BM, BLOCK_D=BD, PREC=dot_precision(q.dtype), OFF=off,
    )  # fmt: skip
    return out, lse


def _backward(q, k, v, doc, start, end, out, lse, dout, scale, block):
    B, L, H, D = q.shape
    Lk = k.shape[1]
    dq = new_output((B, L, H, D), q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    if B * L * H == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, L]
    BM, BD = _blocks(Lk, D, block)
    _bwd_dq_kernel[(triton.cdiv(L, BM), B * H)](
        q, k, v, doc, start, dout, lse, delta, dq, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        L, H, D,
        BLOCK_M=BM, BLOCK_N=BM, BLOCK_D=BD, PREC=dot_precision(q.dtype), OFF=Lk - L,
    )  # fmt: skip
    _bwd_dkdv_kernel[(triton.cdiv(Lk, BM), B)](
        q, k, v, doc, end, dout, lse, delta, dk, dv, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        L, H, D,
        BLOCK_M=BM, BLOCK_N=BM, BLOCK_D=BD, PREC=dot_precision(q.dtype), OFF=Lk - L,
    )  # fmt: skip
    return dq, dk, dv


class _DenseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_ids, scale, block):
        query_offset(q.shape[1], k.shape[1])  # validates Lq <= Lk
        doc = doc_ids.to(torch.int32).contiguous()
        start, end = _doc_bounds(doc)
        out, lse = _forward(q, k, v, doc, start, scale, block)
        ctx.save_for_backward(q, k, v, doc, start, end, out, lse)
        ctx.cfg = (scale, block)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, doc, start, end, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, doc, start, end, out, lse, dout, *ctx.cfg)
        needs = ctx.needs_input_grad
        return (
            dq if needs[0] else None,
            dk if needs[1] else None,
            dv if needs[2] else None,
            None,
            None,
            None,
        )


@register(
    "dense_attention",
    "triton",
    device_types=("cuda",),
    priority=20,
    available=lambda: HAVE_TRITON,
)
def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float,
    block: int | None = None,
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [B, Lk, D] (one shared KV head); doc_ids [B, Lk] non-decreasing
    -> [B, Lq, H, D]. Lq <= Lk: the queries are the last Lq key positions.

    Same contract and result as the reference. `block` (query/key tile length, rounded up to
    a power of two >= 16) is for tests and tuning.
    """
    if not HAVE_TRITON:
        raise RuntimeError("the triton dense_attention backend needs the triton package")
    # The kernels find each document from its first token (contiguous runs): other rows gave
    # wrong results silently where the reference masks by id. wanka's loader, CP shards and KV
    # cache build such rows by construction, so on a device the check must not cost a host
    # sync per call (decoding calls this in every layer for every token): an asynchronous
    # device assert there, none inside a compiled graph; a ValueError on the CPU (interpreter).
    if doc_ids.device.type == "cpu":
        check_doc_ids(doc_ids)
    elif doc_ids.shape[1] > 1 and not torch.compiler.is_compiling():
        torch._assert_async((doc_ids[:, 1:] >= doc_ids[:, :-1]).all())
    return _DenseAttention.apply(q, k, v, doc_ids, float(scale), block)
