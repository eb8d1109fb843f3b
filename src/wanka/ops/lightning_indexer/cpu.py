"""Lightning indexer on CPU, chunked over queries: never a full [L, L] score matrix.

Forward, per batch row and per chunk of C queries [t0, t1): score only the keys the chunk can
see, i.e. from the start of the document of query t0 up to t1 - 1 (doc_ids rows are
non-decreasing, so no query of the chunk sees anything earlier), as one GEMM
[C * Hi, Di] x [Di, span] -> ReLU -> weighted sum over the Hi heads -> [C, span]; mask the
future and earlier documents with -inf; take the top-k of the chunk. Peak extra memory is
O(C * Hi * L) instead of the reference's O(Hi * L^2).

Backward is a custom autograd.Function that saves only q, k, w, the indices and the document
starts, and recomputes per chunk (ReLU'(x) = (x > 0)); autograd never holds per-chunk tensors
for the whole sequence. Two paths, picked by the mean visible span vs k (BWD_DENSE_RATIO):
* dense: recompute the chunk's visible tile with GEMMs as in the forward, with the upstream
  gradient scattered into a [C, span] tile (zero off the selected keys); dq, dk by GEMM.
  Cost ~ visible span; the default while span <= 6 k (e.g. L = 8k, k = 2k).
* sparse: gather the k selected keys [C, K, Di], recompute their dots, dq and dw per query
  row, dk accumulated with index_add_. Cost ~ k; wins when the span is much longer than k.

Output contract matches the reference: indices [B, L, topk] int64 (-1 in empty slots), scores
[B, L, topk] (-inf in empty slots), sorted by descending score, padded when fewer keys are
visible. Ties follow the reference's rule (the most recent key wins), so the selected set is
the reference's; equal scores inside the selection may be listed in another order.

Queries may be a suffix of the keys (q / w [B, Lq, ...], k / doc_ids [B, Lk], query i at key
position Lk - Lq + i; `wanka.ops.registry` docstring): chunks are taken over the queries,
and everything on the key side (spans, masks, indices) uses their key positions.
"""

from __future__ import annotations

import os

import torch

from wanka.ops.common import POISON_ENV, new_output
from wanka.ops.dense_attention.cpu import check_doc_ids
from wanka.ops.dense_attention.reference import query_offset
from wanka.ops.registry import register

# Elements of the largest per-chunk intermediate ([C, Hi, span] forward, [C, K, Di] backward).
CHUNK_ELEMS = 1 << 24
# Backward recomputes the dense visible tile with GEMMs (cost ~ visible span) when the mean
# visible span is at most this many times k; else it gathers the k selected keys per query
# (cost ~ k, but gather / index_add_ are several times slower per element than GEMM).
BWD_DENSE_RATIO = 6.0

_matmul = torch.matmul  # every score-tile GEMM goes through here (tests spy on the shapes)


def _chunk_scores(q_c: torch.Tensor, k_s: torch.Tensor, w_c: torch.Tensor) -> torch.Tensor:
    """q_c [C, Hi, Di], k_s [S, Di], w_c [C, Hi] -> [C, S] = sum_j w_c[:, j] relu(q_c[:, j] . k_s).

    Module-level so tests can check that no call sees more than a chunk of queries."""
    C, Hi, Di = q_c.shape
    d = _matmul(q_c.reshape(C * Hi, Di), k_s.t()).relu_().view(C, Hi, -1)
    return torch.bmm(w_c[:, None, :], d).squeeze(1)


def _gather_keys(k_row: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """k_row [L, Di], idx [C, K] (>= 0) -> [C, K, Di]. Module-level for the same reason."""
    return k_row[idx]


def _select_topk(sc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of sc [n, S] -> (values, column indices) sorted by descending value,
    with the reference's tie rule (reference.select_topk): among equal scores the most recent
    key (highest column) wins. torch.topk breaks ties arbitrarily, so rows where the k-th value
    is finite and also occurs outside the selection are redone exactly; ties inside the
    selection may be listed in a different order than the reference (same set)."""
    vals, idx = sc.topk(k, dim=-1, sorted=True)
    thr = vals[:, -1:]
    n_eq = (sc == thr).sum(-1)
    ambiguous = torch.isfinite(thr[:, 0]) & (n_eq > (vals == thr).sum(-1))
    if bool(ambiguous.any()):
        rows = ambiguous.nonzero().view(-1)
        s, t = sc[rows], thr[rows]
        above = s > t
        need = k - above.sum(-1, keepdim=True)
        eq = s == t
        from_right = eq.flip(-1).cumsum(-1).flip(-1)  # equal entries at or right of column
        chosen = above | (eq & (from_right <= need))
        sel = chosen.nonzero()[:, 1].view(-1, k)  # ascending columns, exactly k per row
        v = s.gather(1, sel).flip(-1)
        sel = sel.flip(-1)  # descending columns: a stable sort keeps recent-first among ties
        order = torch.sort(v, dim=-1, descending=True, stable=True).indices
        vals[rows] = v.gather(1, order)
        idx[rows] = sel.gather(1, order)
    return vals, idx


def _new_index_output(shape, device) -> torch.Tensor:
    """int64 twin of common.new_output (which NaN-fills, impossible for ints): poisoned with
    int64 min under WANKA_OPS_POISON=1."""
    if os.environ.get(POISON_ENV) == "1":
        return torch.full(shape, torch.iinfo(torch.int64).min, dtype=torch.int64, device=device)
    return torch.empty(shape, dtype=torch.int64, device=device)


def _doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L] index of the first token of each token's document."""
    B, L = doc_ids.shape
    pos = torch.arange(L, device=doc_ids.device).expand(B, L)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values


def _fwd_chunk(L: int, Hi: int) -> int:
    return max(1, min(L, CHUNK_ELEMS // max(1, Hi * L)))


def _bwd_chunk(L: int, K: int, Hi: int, Di: int) -> int:
    return max(1, min(L, CHUNK_ELEMS // max(1, K * (Di + Hi))))


class _ChunkedIndexer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, doc_ids, topk: int, chunk_size: int | None):
        B, L, Hi, Di = q.shape
        off = query_offset(L, k.shape[1])  # key position of query 0
        starts = _doc_starts(doc_ids)
        C = max(1, min(chunk_size or _fwd_chunk(k.shape[1], Hi), L))
        idx_out = _new_index_output((B, L, topk), q.device)
        val_out = new_output((B, L, topk), q.dtype, q.device)
        ninf = float("-inf")
        future = torch.ones(C, C, dtype=torch.bool, device=q.device).triu_(1)
        for b in range(B):
            st = starts[b]
            st_list = st.tolist()
            for t0 in range(0, L, C):
                t1 = min(L, t0 + C)
                p0, p1 = off + t0, off + t1  # key positions of the chunk's queries
                s0 = st_list[p0]
                sc = _chunk_scores(q[b, t0:t1], k[b, s0:p1], w[b, t0:t1])  # [C, span]
                n = t1 - t0
                # Future keys: only the [n, n] block of the chunk's own positions.
                sc[:, p0 - s0 :].masked_fill_(future[:n, :n], ninf)
                s_max = st_list[p1 - 1]  # later queries may start a newer document
                if s_max > s0:
                    key_pos = torch.arange(s0, s_max, device=q.device)
                    sc[:, : s_max - s0].masked_fill_(key_pos[None, :] < st[p0:p1, None], ninf)
                kc = min(topk, p1 - s0)
                vals, idx = _select_topk(sc, kc)
                idx += s0
                idx.masked_fill_(vals == ninf, -1)
                idx_out[b, t0:t1, :kc] = idx
                val_out[b, t0:t1, :kc] = vals
                if kc < topk:
                    idx_out[b, t0:t1, kc:] = -1
                    val_out[b, t0:t1, kc:] = ninf
        ctx.save_for_backward(q, k, w, idx_out, starts[:, off:])  # the queries' doc starts
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(idx_out)
        return idx_out, val_out

    @staticmethod
    def backward(ctx, _g_idx, g_val):
        q, k, w, idx_all, starts = ctx.saved_tensors
        B, L, Hi, Di = q.shape
        K = idx_all.shape[-1]
        need_q, need_k, need_w = ctx.needs_input_grad[:3]
        dq = new_output(q.shape, q.dtype, q.device)
        dw = new_output(w.shape, w.dtype, w.device)
        dk = torch.zeros_like(k)
        valid_all = idx_all >= 0
        g_all = g_val.masked_fill(~valid_all, 0.0).to(q.dtype)
        pos = torch.arange(k.shape[1] - L, k.shape[1], device=q.device)  # queries' key positions
        mean_span = float((pos - starts + 1).double().mean())
        if mean_span <= BWD_DENSE_RATIO * K:
            _bwd_dense(q, k, w, idx_all, g_all, starts, ctx.chunk_size, dq, dk, dw)
        else:
            _bwd_sparse(q, k, w, idx_all, g_all, valid_all, (need_q, need_k, need_w), dq, dk, dw)
        return (
            dq if need_q else None,
            dk if need_k else None,
            dw if need_w else None,
            None,
            None,
            None,
        )


def _bwd_dense(q, k, w, idx_all, g_all, starts, chunk_size, dq, dk, dw) -> None:
    """Recompute each chunk's visible tile with GEMMs, like the forward; the upstream gradient
    is scattered into a dense [C, span] tile (zero off the selected keys). starts [B, Lq]:
    the document start (key position) of each query."""
    B, L, Hi, Di = q.shape
    off = k.shape[1] - L
    C = max(1, min(chunk_size or _fwd_chunk(k.shape[1], Hi), L))
    for b in range(B):
        st_list = starts[b].tolist()
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            s0, p1 = st_list[t0], off + t1
            n, span = t1 - t0, p1 - s0
            ic = (idx_all[b, t0:t1] - s0).clamp_(min=0)  # empty slots carry gradient 0
            g = torch.zeros(n, span, dtype=q.dtype, device=q.device)
            g.scatter_add_(1, ic, g_all[b, t0:t1])
            qf = q[b, t0:t1].reshape(n * Hi, Di)
            k_s = k[b, s0:p1]
            r = _matmul(qf, k_s.t()).relu_().view(n, Hi, span)  # [n, Hi, span]
            dw[b, t0:t1] = torch.bmm(r, g[:, :, None]).squeeze(-1)
            # r >= 0, so sign(r) is ReLU'(dots); r is not needed after dw: reuse it in place.
            dr = r.sign_().mul_(w[b, t0:t1, :, None]).mul_(g[:, None, :])
            dr = dr.view(n * Hi, span)
            dq[b, t0:t1] = _matmul(dr, k_s).view(n, Hi, Di)
            dk[b, s0:p1].addmm_(dr.t(), qf)


def _bwd_sparse(q, k, w, idx_all, g_all, valid_all, needs, dq, dk, dw) -> None:
    """Gather the selected keys per chunk [C, K, Di]; dk accumulated with index_add_. Cost
    scales with K, not with the visible span: wins for long sequences with small k."""
    B, L, Hi, Di = q.shape
    K = idx_all.shape[-1]
    need_q, need_k, need_w = needs
    n_valid = valid_all.sum(-1)  # valid slots come first (sorted by score)
    C = _bwd_chunk(L, K, Hi, Di)
    for b in range(B):
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            kv = int(n_valid[b, t0:t1].max())
            if kv == 0:
                dq[b, t0:t1] = 0
                dw[b, t0:t1] = 0
                continue
            ic = idx_all[b, t0:t1, :kv].clamp(min=0)  # [C, kv]
            gc = g_all[b, t0:t1, :kv]  # [C, kv], 0 in empty slots
            qc, wc = q[b, t0:t1], w[b, t0:t1]  # [C, Hi, Di], [C, Hi]
            ksel = _gather_keys(k[b], ic)  # [C, kv, Di]
            dots = torch.bmm(qc, ksel.transpose(1, 2))  # [C, Hi, kv]
            if need_w:
                dw[b, t0:t1] = torch.bmm(dots.relu(), gc[:, :, None]).squeeze(-1)
            dr = (dots > 0).to(q.dtype).mul_(wc[:, :, None]).mul_(gc[:, None, :])
            if need_q:
                dq[b, t0:t1] = torch.bmm(dr, ksel)
            if need_k:
                dks = torch.bmm(dr.transpose(1, 2), qc)  # [C, kv, Di]
                dk[b].index_add_(0, ic.reshape(-1), dks.reshape(-1, Di))


@register("lightning_indexer", "cpu", device_types=("cpu",), priority=10)
def lightning_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    doc_ids: torch.Tensor,
    topk: int,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Lq, Hi, Di], k [B, Lk, Di], w [B, Lq, Hi], doc_ids [B, Lk] (rows
    non-decreasing; Lq <= Lk: the queries are the last Lq key positions) -> (indices
    [B, Lq, topk] int64 key positions with -1 in empty slots, scores [B, Lq, topk] with -inf
    in empty slots, differentiable w.r.t. q, k, w). `chunk_size` queries are scored at a
    time (default: as many as fit CHUNK_ELEMS elements of [C, Hi, Lk])."""
    check_doc_ids(doc_ids)
    return _ChunkedIndexer.apply(q, k, w, doc_ids, topk, chunk_size)
