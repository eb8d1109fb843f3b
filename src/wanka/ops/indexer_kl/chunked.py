"""Dense warm-up indexer KL, chunked over query blocks: never an [L, L] matrix.

Same value and gradients as `reference.indexer_kl` (the full [B, L, L] indexer scores and
the full [B, L, H, L] attention target), with peak extra memory O(C * max(H, Hi) * L) for a
block of C queries instead of O(H * L^2):

* forward, per batch row and per block of C queries [t0, t1): only the keys the block can
  see are touched, from the document start of query t0 to t1 - 1 (doc_ids rows are
  non-decreasing), giving [C, span] tiles. The target is the attention distribution summed
  over the H heads and renormalised ([C*H, D] x [D, span] GEMM, masked softmax), the indexer
  scores are sum_j w_j ReLU(q_j . k) ([C*Hi, Di] x [Di, span] GEMM), and the block adds
  sum KL(p || softmax(scores)) over its visible keys.
* gradients: the loss is a scalar, so a custom autograd.Function computes them in the same
  pass, block by block, with upstream gradient 1: d KL / d score(t, s) =
  softmax(scores)(t, s) * sum_s p(t, s) - p(t, s) on visible keys (0 elsewhere), then the
  indexer's dq, dk, dw with GEMMs (ReLU'(x) = (x > 0)). It keeps only those O(L) gradients
  (nothing of the [L, L] kind) and the backward just scales them by the upstream gradient:
  the target is never recomputed. This is skipped when no indexer input requires a
  gradient. The attention q and k get no gradient (the reference's target is computed
  without one either).

Queries may be a suffix of the keys (q / qi / wi [B, Lq, ...], k / ki / doc_ids [B, Lk],
query i at key position Lk - Lq + i; `wanka.ops.registry` docstring): blocks are taken over
the queries, and spans and masks use their key positions.

Generic torch (GEMMs, softmax): valid on every device, so it is registered for all of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from wanka.ops.dense_attention.cpu import check_doc_ids
from wanka.ops.dense_attention.reference import query_offset
from wanka.ops.lightning_indexer.cpu import _doc_starts
from wanka.ops.registry import register

# Elements of the largest per-block intermediate ([C, max(H, Hi), span] logits).
CHUNK_ELEMS = 1 << 24


def _rows(L: int, H: int, Hi: int, chunk_size: int | None, Lk: int | None = None) -> int:
    """Queries per block, of L queries over Lk (default L) keys."""
    if chunk_size is not None:
        return max(1, min(int(chunk_size), L))
    return max(1, min(L, CHUNK_ELEMS // max(1, max(H, Hi) * (Lk or L))))


def _visible(t0: int, t1: int, s0: int, starts_row: torch.Tensor) -> torch.Tensor:
    """[t1 - t0, t1 - s0] bool: key s0 + j is visible to the query at key position t0 + i
    (causal, same doc; starts_row [Lk] indexed by key position)."""
    dev = starts_row.device
    pos_q = torch.arange(t0, t1, device=dev)[:, None]
    pos_k = torch.arange(s0, t1, device=dev)[None, :]
    return (pos_k <= pos_q) & (pos_k >= starts_row[t0:t1, None])


def _target(q_c, k_s, vis, scale):
    """Attention target of one query block: q_c [n, H, D], k_s [span, D] -> [n, span]
    float32, the softmax over visible keys summed over the H heads and renormalised.
    Module-level so tests can check the tile sizes."""
    n, H, D = q_c.shape
    span = k_s.shape[0]
    with torch.no_grad():
        logits = torch.matmul(q_c.reshape(n * H, D), k_s.t()).float().mul_(scale)
        logits = logits.view(n, H, span).masked_fill_(~vis[:, None], float("-inf"))
        p = torch.softmax(logits, dim=-1).sum(dim=1)
        return p / p.sum(dim=-1, keepdim=True)


def _scores(qi_c, ki_s, wi_c, vis):
    """Indexer scores of one query block: qi_c [n, Hi, Di], ki_s [span, Di], wi_c [n, Hi]
    -> (ReLU(dots) [n, Hi, span], scores [n, span] float32 with -inf on hidden keys)."""
    n, Hi, Di = qi_c.shape
    r = torch.matmul(qi_c.reshape(n * Hi, Di), ki_s.t()).relu_().view(n, Hi, -1)
    sc = torch.bmm(wi_c[:, None, :], r).squeeze(1).float()
    return r, sc.masked_fill_(~vis, float("-inf"))


def _kl_block(p: torch.Tensor, sc: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    logq = F.log_softmax(sc, dim=-1).masked_fill(~vis, 0.0)
    return (torch.xlogy(p, p) - p * logq).sum()


class _ChunkedKL(torch.autograd.Function):
    """The loss is a scalar, so its gradients are computed block by block in the forward
    (with upstream gradient 1) and only scaled in the backward: no recomputation of the
    target, and nothing O(L^2) kept."""

    @staticmethod
    def forward(ctx, q, k, qi, ki, wi, doc_ids, scale, chunk_size):
        B, L, H, _ = q.shape
        Hi, Di = qi.shape[2:]
        off = query_offset(L, k.shape[1])  # key position of query 0
        starts = _doc_starts(doc_ids)
        C = _rows(L, H, Hi, chunk_size, k.shape[1])
        want_grad = any(ctx.needs_input_grad[2:5])
        if want_grad:
            dqi, dwi = torch.empty_like(qi), torch.empty_like(wi)
            dki = torch.zeros(ki.shape, dtype=torch.float32, device=ki.device)
        parts = []
        with torch.no_grad():
            for b in range(B):
                st = starts[b].tolist()
                for t0 in range(0, L, C):
                    t1 = min(L, t0 + C)
                    p0, p1 = off + t0, off + t1  # key positions of the block's queries
                    s0 = st[p0]
                    n, span = t1 - t0, p1 - s0
                    vis = _visible(p0, p1, s0, starts[b])
                    qi_c, ki_s, wi_c = qi[b, t0:t1], ki[b, s0:p1], wi[b, t0:t1]
                    p = _target(q[b, t0:t1], k[b, s0:p1], vis, scale)
                    r, sc = _scores(qi_c, ki_s, wi_c, vis)
                    parts.append(_kl_block(p, sc, vis))
                    if not want_grad:
                        continue
                    # d KL / d scores: softmax(scores) * sum(p) - p (0 on hidden keys)
                    soft = torch.softmax(sc, dim=-1)
                    ds = (soft * p.sum(-1, keepdim=True) - p).to(qi.dtype)  # [n, span]
                    dwi[b, t0:t1] = torch.bmm(r, ds[:, :, None]).squeeze(-1)
                    # r >= 0, so sign(r) is ReLU'(dots); r is not needed after dw: reuse it.
                    dr = r.sign_().mul_(wi_c[:, :, None]).mul_(ds[:, None, :])
                    dr = dr.view(n * Hi, span)
                    dqi[b, t0:t1] = torch.matmul(dr, ki_s).view(n, Hi, Di)
                    dki[b, s0:p1] += torch.matmul(dr.t(), qi_c.reshape(n * Hi, Di)).float()
        if want_grad:
            ctx.save_for_backward(dqi, dki.to(ki.dtype), dwi)
        if not parts:
            return torch.zeros((), dtype=torch.float32, device=q.device)
        return torch.stack(parts).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        dqi, dki, dwi = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            None,
            None,
            dqi * g.to(dqi.dtype) if needs[2] else None,
            dki * g.to(dki.dtype) if needs[3] else None,
            dwi * g.to(dwi.dtype) if needs[4] else None,
            None,
            None,
            None,
        )


@register("indexer_kl", "chunked", device_types=("*",), priority=10)
def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    wi: torch.Tensor,
    doc_ids: torch.Tensor,
    scale: float,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Same contract as `reference.indexer_kl`: q [B, Lq, H, D], k [B, Lk, D] (the target, no
    gradient), qi [B, Lq, Hi, Di], ki [B, Lk, Di], wi [B, Lq, Hi] -> scalar float32 KL sum
    over the B * Lq queries, differentiable w.r.t. qi, ki, wi. Lq <= Lk: the queries are the
    last Lq key positions. doc_ids [B, Lk] rows must be non-decreasing.
    `chunk_size` queries are processed at a time (default: as many as keep the largest
    per-block intermediate [C, max(H, Hi), Lk] under CHUNK_ELEMS elements)."""
    check_doc_ids(doc_ids)
    return _ChunkedKL.apply(q, k, qi, ki, wi, doc_ids, float(scale), chunk_size)
