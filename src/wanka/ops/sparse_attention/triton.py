"""DSA sparse attention (MQA, top-k indices) in Triton for CUDA: forward and backward.

Same contract and result as `reference.sparse_attention`. One program per (batch, query):
all H query heads are processed together since they share the single K/V head. The
program walks the query's K selected slots in tiles of BLOCK_K, gathers the selected
K/V rows by pointer arithmetic (-1 slots masked), and keeps an online softmax
(FlashAttention-2 style). The forward saves the log-sum-exp [B, L, H]; the backward
recomputes P = exp(S - lse), takes delta = rowsum(dO * O) from torch, writes dQ directly
and accumulates dK/dV into float32 buffers with atomic adds (several queries select the
same key), so dK/dV may differ at the last bit from run to run on a GPU.

Heads, head dim and the slot tile are padded to powers of two >= 16 (masked) so every
product is a `tl.dot`. float32 inputs use IEEE-precision dots; 16-bit inputs are upcast
to float32 and use TF32.

Queries may be a suffix of the keys (q / indices [B, Lq, ...], k / v [B, Lk, D]; indices are
key positions; `wanka.ops.registry` docstring): programs run per query and K/V rows are
reached only through the indices, so nothing else changes.

Triton is optional: without it this module registers an unavailable backend and defines
no kernels. Tests run the kernels on CPU tensors with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.registry import register
from wanka.ops.triton_common import HAVE_TRITON, dot_precision, pow2, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _fwd_kernel(
        Q, Kp, Vp, IDX, OUT, LSE, scale,
        sqb, sql, sqh, sqd, skb, skl, skd, svb, svl, svd, sib, sil,
        sob, sol, soh, sod, slb, sll, slh,
        L, H, D, KSEL,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = (pid // L).to(tl.int64)
        t = (pid % L).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        hm = offs_h < H
        dm = offs_d < D
        qmask = hm[:, None] & dm[None, :]
        q = tl.load(
            Q + b * sqb + t * sql + offs_h[:, None] * sqh + offs_d[None, :] * sqd,
            mask=qmask,
            other=0.0,
        ).to(tl.float32)
        q = q * scale
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        lsum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        idx_base = b * sib + t * sil
        for k0 in range(0, KSEL, BLOCK_K):
            # gather the tile's selected K/V rows; -1 slots (and slots past K) are masked
            kk = k0 + offs_k
            idx = tl.load(IDX + idx_base + kk, mask=kk < KSEL, other=-1)
            valid = idx >= 0
            safe = tl.where(valid, idx, 0).to(tl.int64)
            m2 = valid[:, None] & dm[None, :]
            kp = Kp + b * skb + safe[:, None] * skl + offs_d[None, :] * skd
            vp = Vp + b * svb + safe[:, None] * svl + offs_d[None, :] * svd
            kt = tl.load(kp, mask=m2, other=0.0).to(tl.float32)  # [BK, BD]
            vt = tl.load(vp, mask=m2, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC)  # [BH, BK]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision=PREC)
            m = m_new
        lsum = tl.where(lsum > 0, lsum, 1.0)  # padded heads only: every row has a valid slot
        out = acc / lsum[:, None]
        lse = m + tl.log(lsum)
        tl.store(
            OUT + b * sob + t * sol + offs_h[:, None] * soh + offs_d[None, :] * sod,
            out.to(OUT.dtype.element_ty),
            mask=qmask,
        )
        tl.store(LSE + b * slb + t * sll + offs_h * slh, lse, mask=hm)

    @triton.jit
    def _bwd_kernel(
        Q, Kp, Vp, IDX, DO, LSE, DELTA, DQ, DK, DV, scale,
        sqb, sql, sqh, sqd, skb, skl, skd, svb, svl, svd, sib, sil,
        sdob, sdol, sdoh, sdod, slb, sll, slh,
        sdqb, sdql, sdqh, sdqd, sgb, sgl, sgd,
        L, H, D, KSEL,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
        PREC: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = (pid // L).to(tl.int64)
        t = (pid % L).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_k = tl.arange(0, BLOCK_K)
        hm = offs_h < H
        dm = offs_d < D
        qmask = hm[:, None] & dm[None, :]
        hd_q = offs_h[:, None] * sqh + offs_d[None, :] * sqd
        q = tl.load(Q + b * sqb + t * sql + hd_q, mask=qmask, other=0.0).to(tl.float32)
        q = q * scale
        do = tl.load(
            DO + b * sdob + t * sdol + offs_h[:, None] * sdoh + offs_d[None, :] * sdod,
            mask=qmask,
            other=0.0,
        ).to(tl.float32)
        lh = b * slb + t * sll + offs_h * slh
        lse = tl.load(LSE + lh, mask=hm, other=0.0)
        delta = tl.load(DELTA + lh, mask=hm, other=0.0)
        dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        idx_base = b * sib + t * sil
        for k0 in range(0, KSEL, BLOCK_K):
            # gather the tile's selected K/V rows; -1 slots (and slots past K) are masked
            kk = k0 + offs_k
            idx = tl.load(IDX + idx_base + kk, mask=kk < KSEL, other=-1)
            valid = idx >= 0
            safe = tl.where(valid, idx, 0).to(tl.int64)
            m2 = valid[:, None] & dm[None, :]
            kp = Kp + b * skb + safe[:, None] * skl + offs_d[None, :] * skd
            vp = Vp + b * svb + safe[:, None] * svl + offs_d[None, :] * svd
            kt = tl.load(kp, mask=m2, other=0.0).to(tl.float32)  # [BK, BD]
            vt = tl.load(vp, mask=m2, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(kt), input_precision=PREC)  # [BH, BK]
            p = tl.exp(s - lse[:, None])
            p = tl.where(hm[:, None] & valid[None, :], p, 0.0)
            dp = tl.dot(do, tl.trans(vt), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds, kt, input_precision=PREC)
            gmask = valid[:, None] & dm[None, :]
            grow = b * sgb + safe[:, None] * sgl + offs_d[None, :] * sgd
            dv_t = tl.dot(tl.trans(p), do, input_precision=PREC)  # [BK, BD]
            tl.atomic_add(DV + grow, dv_t, mask=gmask)
            dk_t = tl.dot(tl.trans(ds), q, input_precision=PREC)  # q is already scaled
            tl.atomic_add(DK + grow, dk_t, mask=gmask)
        dq = dq * scale
        tl.store(
            DQ + b * sdqb + t * sdql + offs_h[:, None] * sdqh + offs_d[None, :] * sdqd,
            dq.to(DQ.dtype.element_ty),
            mask=qmask,
        )


def _blocks(H: int, D: int, K: int, block_k: int | None):
    bk = pow2(min(K, 32)) if block_k is None else pow2(block_k)
    return pow2(H), pow2(D), bk


def _forward(q, k, v, indices, scale, block_k):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    out = new_output((B, L, H, D), q.dtype, q.device)
    lse = new_output((B, L, H), torch.float32, q.device)
    if B * L == 0:
        return out, lse
    indices = indices.contiguous()
    BH, BD, BK = _blocks(H, D, K, block_k)
    _fwd_kernel[(B * L,)](
        q, k, v, indices, out, lse, float(scale),
        *q.stride(), *k.stride(), *v.stride(), indices.stride(0), indices.stride(1),
        *out.stride(), *lse.stride(),
        L, H, D, K,
        BLOCK_H=BH, BLOCK_D=BD, BLOCK_K=BK, PREC=dot_precision(q.dtype),
    )  # fmt: skip
    return out, lse


def _backward(q, k, v, indices, out, lse, dout, scale, block_k):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    dq = new_output((B, L, H, D), q.dtype, q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # accumulated
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if B * L == 0:
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # [B, L, H], lse's layout
    indices = indices.contiguous()
    BH, BD, BK = _blocks(H, D, K, block_k)
    _bwd_kernel[(B * L,)](
        q, k, v, indices, dout, lse, delta, dq, dk, dv, float(scale),
        *q.stride(), *k.stride(), *v.stride(), indices.stride(0), indices.stride(1),
        *dout.stride(), *lse.stride(), *dq.stride(), *dk.stride(),
        L, H, D, K,
        BLOCK_H=BH, BLOCK_D=BD, BLOCK_K=BK, PREC=dot_precision(q.dtype),
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, block_k):
        out, lse = _forward(q, k, v, indices, scale, block_k)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.cfg = (scale, block_k)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, indices, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, indices, out, lse, dout, *ctx.cfg)
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
    "sparse_attention",
    "triton",
    device_types=("cuda",),
    priority=20,
    available=lambda: HAVE_TRITON,
)
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    block_k: int | None = None,
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [B, Lk, D]; indices [B, Lq, K] int64 key positions (-1 = empty)
    -> [B, Lq, H, D]; Lq <= Lk.

    Same contract and result as the reference. `block_k` (slots per tile, rounded up to a
    power of two >= 16) is for tests and tuning.
    """
    if not HAVE_TRITON:
        raise RuntimeError("the triton sparse_attention backend needs the triton package")
    return _SparseAttention.apply(q, k, v, indices, float(scale), block_k)
