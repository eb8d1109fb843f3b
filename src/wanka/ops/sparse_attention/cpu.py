"""DSA sparse attention (MQA, top-k indices) on CPU: chunked, exact, with its own backward.

Same math as `reference.sparse_attention`, but it never materialises the gathered
[B, L, K, D] keys/values: queries are processed one chunk of C at a time, forward and
backward (FlashAttention-2 style: the forward saves only q, k, v, indices, out and the
log-sum-exp [B, L, H]; the backward recomputes the probabilities chunk by chunk,
dS = P * (dP - rowsum(dO * O)), and accumulates dK/dV with index_add_).

Each chunk splits the key columns it uses into two exact parts (one softmax over both):

- dense ("union") part: key columns selected by many queries of the chunk. Their rows
  K[U] [u, D] are gathered once and scored with one GEMM [C*H, D] x [D, u]; each query is
  masked to its own selection by a [C, u] mask. Windowed / heavy-hitter patterns put nearly
  everything here: big GEMMs instead of C tiny ones, and u ~ K + C rows of K/V read instead
  of C * K.
- gather part: the remaining (rare) selections, compacted to [C, Kr] and computed with
  batched matmuls over gathered rows [C, Kr, D] ([C, H, D] x [C, D, Kr]). Works for any
  pattern; random indices land here entirely.

`strategy="auto"` sends a key column to the dense part when at least C / DENSE_DIVISOR of
the chunk's queries select it (dense costs C score rows per column, gather one per use at a
worse rate); "union" sends every column there, "gather" none (both for tests/benchmarks).

Index contract (the reference's, on every backend): per-slot. Each valid slot is one term
of the softmax, so a key selected twice by one query counts twice. The dense part's mask
holds each (query, key) pair once; a pair selected more than once goes to the gather part
(whose slots are counted one by one), found per chunk by one scatter-add of counts.

Non-finite isolation: an empty slot (-1) reads a zero row appended to K and V (row Lk),
never row 0, and its score is replaced (masked_fill, not multiplied) by -inf. The dense
GEMMs also compute masked (query, key) products, whose exact-zero weights would turn an
inf into NaN (0 * inf); so K/V rows holding a non-finite value never go dense (checked once
per sequence), and in the backward neither do queries whose log-sum-exp or rowsum(dO * O)
is non-finite (checked per chunk; their rows enter the dense GEMMs as zeros). Both go
through the gather part, where each query only touches its own slots: a non-finite value
stays in the rows of the queries that select it (the forward's GEMM rows are per query, so
a non-finite query needs nothing there).

Threads: with N > 1 torch threads, chunks run in parallel on N worker threads of this
module, each running single-threaded torch ops (no OpenMP team per op, so a busy or
oversubscribed machine does not make every small op wait for its slowest thread). The
forward's chunks write disjoint outputs; the backward accumulates dK/dV per group of
chunks (a fixed split, summed in order: the result does not depend on scheduling). With
1 thread (training ranks) everything runs in the calling thread, as before.

Queries may be a suffix of the keys (q / indices [B, Lq, ...], k / v [B, Lk, D]; indices are
key positions in [0, Lk); `wanka.ops.registry` docstring): chunks run over the Lq queries,
K/V (and their zero row Lk, dK/dV) over the Lk keys.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.registry import register

STRATEGIES = ("auto", "gather", "union")
DEFAULT_CHUNK = 128
DENSE_DIVISOR = 1.5
# The gathered [C, Kr, D] keys (and values) of one chunk stay under this many elements.
GATHER_BUDGET = 1 << 22
# Backward work units (groups of chunks, each with its own dK/dV buffer) per worker thread:
# enough for a thread slowed by other load to hand work to the others.
GROUPS_PER_THREAD = 4


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
    """How one chunk's selections [C, K] split into the dense and gather parts.

    `pad` is the zero row appended to K/V (empty slots read it). `bad_key` [pad + 1] bool
    marks K/V rows with a non-finite value, `bad_query` [C] queries with a non-finite
    log-sum-exp or delta (backward): their selections never go dense. The gather part's
    slots are `ridx` [C, kr] (pad where empty), valid where `rvalid`; the dense part's
    columns `dcols` [u], and `dmask_off` [C, u] is True where a query does not take a
    column."""

    __slots__ = ("dcols", "dmask_off", "ridx", "rvalid")

    def __init__(self, idx, min_count, pad, bad_key=None, bad_query=None):
        valid = idx >= 0
        safe = idx.masked_fill(~valid, pad)
        self.dcols = self.dmask_off = None
        self.ridx, self.rvalid = safe, valid
        if min_count is None:
            return
        C, K = idx.shape
        elig = valid
        if bad_key is not None:
            elig = elig & ~bad_key[safe]
        if bad_query is not None:
            elig = elig & ~bad_query[:, None]
        hi = int(idx.masked_fill(~elig, -1).max()) if idx.numel() else -1
        if hi < 0:  # nothing may go dense
            return
        lo = int(idx.masked_fill(~elig, hi).min())
        n = hi - lo + 1
        rel = (idx - lo).masked_fill_(~elig, n)  # not eligible -> dummy bin n
        counts = torch.bincount(rel.view(-1), minlength=n + 1)
        counts[n] = 0
        dense_col = counts >= min_count  # [n + 1]
        colpos = dense_col.cumsum(0).sub_(1).masked_fill_(~dense_col, -1)
        pos = colpos[rel]  # [C, K]: column of each selection in the dense part, -1 if none
        is_dense = pos >= 0
        u = int(dense_col.sum())
        if u == 0:
            return
        self.dcols = dense_col.nonzero().view(-1).add_(lo)
        slot = pos.masked_fill(~is_dense, u)
        # per (query, column): how many of the query's slots hold it
        cnt = torch.zeros(C, u + 1, dtype=torch.int32)
        cnt.scatter_add_(1, slot, torch.ones(1, 1, dtype=torch.int32).expand(C, K))
        cnt = cnt[:, :u]
        if int(cnt.max()) > 1:  # duplicates: those pairs go to the gather part, slot by slot
            single = cnt == 1
            is_dense &= single.gather(1, slot.clamp(max=u - 1))
            self.dmask_off = ~single
        else:
            self.dmask_off = cnt == 0
        if not bool(is_dense.any()):  # every pair duplicated: all of it is gather work
            self.dcols = self.dmask_off = None
            return
        rare = valid & ~is_dense
        kr = int(rare.sum(1).max())
        if kr == 0:
            self.ridx = self.rvalid = None
        else:  # compact each row's rare selections to the front of [C, kr]
            dest = rare.cumsum(1).sub_(1).masked_fill_(~rare, kr)
            ridx = torch.full((C, kr + 1), pad, dtype=torch.long)
            ridx.scatter_(1, dest, safe)
            self.ridx = ridx[:, :kr]
            self.rvalid = self.ridx != pad


def _scores(qs, kb, plan: _Plan, qd=None):
    """qs [C, H, D] (scaled queries) -> masked scores (dense [C, H, u], gather [C, H, kr],
    each None when absent) and the rows used (Kd [u, D], Kg [C, kr, D]). `qd` replaces qs
    in the dense part (the backward zeroes non-finite queries there)."""
    C, H, D = qs.shape
    sd = sr = kd = kg = None
    if plan.dcols is not None:
        kd = _rows(kb, plan.dcols)
        qd = qs if qd is None else qd
        sd = torch.mm(qd.reshape(C * H, D), kd.t()).view(C, H, -1)
        sd.masked_fill_(plan.dmask_off[:, None, :], float("-inf"))
    if plan.ridx is not None:
        kg = _rows(kb, plan.ridx)
        sr = torch.bmm(qs, kg.transpose(1, 2))
        sr.masked_fill_(~plan.rvalid[:, None, :], float("-inf"))
    return sd, sr, kd, kg


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _padded(k, v, cdt):
    """k, v [B, L, D] -> [B, L + 1, D] in the compute dtype with a zero row L (what empty
    slots read), and per sequence the rows holding a non-finite value ([L + 1] bool, None
    when there are none)."""
    B, L, D = k.shape
    kp = torch.cat([k.to(cdt), k.new_zeros(B, 1, D, dtype=cdt)], 1)
    vp = torch.cat([v.to(cdt), v.new_zeros(B, 1, D, dtype=cdt)], 1)
    bad = ~(torch.isfinite(kp).all(-1) & torch.isfinite(vp).all(-1))  # [B, L + 1]
    return kp, vp, [bad[b] if has else None for b, has in enumerate(bad.any(1).tolist())]


# --- running chunks on worker threads ---------------------------------------------------

_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, threads, executor)
_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """This process's executor of `threads` workers, each set to single-threaded torch ops.

    torch.set_num_threads(1) in a worker sets that thread's OpenMP/MKL thread count, and also
    the process default that threads started later inherit; the caller's own count is
    untouched, and the default is set back once every worker has started."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL[0] == os.getpid() and _POOL[1] == threads:
            return _POOL[2]
        if _POOL is not None and _POOL[0] == os.getpid():
            _POOL[2].shutdown(wait=False)
        ex = ThreadPoolExecutor(threads, thread_name_prefix="wanka-sparse-attention")
        started = threading.Barrier(threads)  # each init on its own thread

        def init():
            torch.get_num_threads()  # this thread's lazy OpenMP set-up first, so 1 sticks
            torch.set_num_threads(1)
            started.wait()

        for f in [ex.submit(init) for _ in range(threads)]:
            f.result()
        torch.set_num_threads(threads)  # the caller's count, back as the process default
        _POOL = (os.getpid(), threads, ex)
        return ex


def _run(n: int, fn, threads: int) -> None:
    """fn(0), ..., fn(n - 1): in this thread when threads <= 1, else on the worker threads
    (taken in order as workers free up), without autograd recording in either case."""
    if threads <= 1 or n <= 1:
        for i in range(n):
            fn(i)
        return

    def task(i):
        with torch.no_grad():
            fn(i)

    futures = [_pool(threads).submit(task, i) for i in range(n)]
    wait(futures)
    for f in futures:
        f.result()  # re-raises a worker's exception


# --- forward and backward ---------------------------------------------------------------


def _forward(q, k, v, indices, scale, strategy, chunk, threads):
    B, L, H, D = q.shape
    Lk = k.shape[1]
    K = indices.shape[-1]
    cdt = _compute_dtype(q.dtype)
    out = new_output((B, L, H, D), q.dtype, q.device)
    # in the compute dtype: a float32 lse would cost float64 gradients their precision
    lse = new_output((B, L, H), cdt, q.device)
    C = _chunk_size(K, D, chunk)
    kp, vp, bad_key = _padded(k, v, cdt)
    tasks = [(b, t0) for b in range(B) for t0 in range(0, L, C)]

    def one(i):
        b, t0 = tasks[i]
        t1 = min(L, t0 + C)
        kb, vb = kp[b], vp[b]
        plan = _Plan(indices[b, t0:t1], _min_count(strategy, t1 - t0), Lk, bad_key[b])
        qs = q[b, t0:t1].to(cdt) * scale
        sd, sr, _, _ = _scores(qs, kb, plan)
        m = torch.stack([s.amax(-1) for s in (sd, sr) if s is not None]).amax(0)  # [C, H]
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
        lse[b, t0:t1] = m + total.log()

    _run(len(tasks), one, threads)
    return out, lse


def _backward(q, k, v, indices, out, lse, dout, scale, strategy, chunk, needs, threads):
    B, L, H, D = q.shape
    Lk = k.shape[1]
    K = indices.shape[-1]
    cdt = _compute_dtype(q.dtype)
    dq = new_output((B, L, H, D), q.dtype, q.device) if needs[0] else None
    C = _chunk_size(K, D, chunk)
    kp, vp, bad_key = _padded(k, v, cdt)
    # Groups of consecutive chunks, never across sequences; each accumulates dK/dV into
    # its own buffer (rows 0 .. hi of what it selects, plus a last row that takes the empty
    # slots' exact zeros), added into dK/dV in group order at the end.
    starts = list(range(0, L, C))
    per_b = 1 if threads <= 1 else max(1, math.ceil(GROUPS_PER_THREAD * threads / B))
    per_b = min(per_b, len(starts))
    groups = []
    for b in range(B):
        for g in range(per_b):
            part = starts[g * len(starts) // per_b : (g + 1) * len(starts) // per_b]
            groups.append((b, part))
    # dK/dV are accumulated (index_add_), so they start from zeros, not new_output.
    dkp = torch.zeros(B, Lk + 1, D, dtype=cdt) if needs[1] else None
    dvp = torch.zeros(B, Lk + 1, D, dtype=cdt) if needs[2] else None
    bufs: list = [None] * len(groups)

    def one(gi):
        b, part = groups[gi]
        kb, vb = kp[b], vp[b]
        if per_b == 1:  # the only group of its sequence: accumulate in place
            rows, dkb = Lk + 1, (dkp[b] if dkp is not None else None)
            dvb = dvp[b] if dvp is not None else None
        else:
            sel = indices[b, part[0] : min(L, part[-1] + C)]
            rows = min(Lk, int(sel.max()) + 1) + 1
            dkb = torch.zeros(rows, D, dtype=cdt) if dkp is not None else None
            dvb = torch.zeros(rows, D, dtype=cdt) if dvp is not None else None
            bufs[gi] = (rows, dkb, dvb)
        for t0 in part:
            t1 = min(L, t0 + C)
            c = t1 - t0
            qs = q[b, t0:t1].to(cdt) * scale
            do = dout[b, t0:t1].to(cdt)
            lse_c = lse[b, t0:t1].to(cdt)[..., None]
            delta = (do * out[b, t0:t1].to(cdt)).sum(-1, keepdim=True)  # [C, H, 1]
            # Queries with a non-finite lse or delta (a non-finite q, dO or O) leave the
            # dense part; their rows in its GEMMs still exist (masked off), so they enter it
            # as zeros: exp(-inf - NaN) or 0 * inf would spread NaN over every column.
            bad_q = ~(torch.isfinite(lse_c) & torch.isfinite(delta)).view(c, H).all(1)
            qd, dod, lsed, deltad = qs, do, lse_c, delta
            if bool(bad_q.any()):
                z = bad_q[:, None, None]
                qd, dod = qs.masked_fill(z, 0.0), do.masked_fill(z, 0.0)
                lsed, deltad = lse_c.masked_fill(z, 0.0), delta.masked_fill(z, 0.0)
            else:
                bad_q = None
            plan = _Plan(indices[b, t0:t1], _min_count(strategy, c), Lk, bad_key[b], bad_q)
            sd, sr, kd, kg = _scores(qs, kb, plan, qd)
            dqc = torch.zeros_like(qs) if dq is not None else None
            if sd is not None:
                do2 = dod.reshape(c * H, D)
                pd = sd.sub_(lsed).exp_().view(c * H, -1)  # [C*H, u]
                vd = _rows(vb, plan.dcols)
                ds = torch.mm(do2, vd.t()).sub_(deltad.view(c * H, 1)).mul_(pd)
                if dqc is not None:
                    dqc += torch.mm(ds, kd).view(c, H, D)
                if dkb is not None:
                    dkb.index_add_(0, plan.dcols, torch.mm(ds.t(), qd.reshape(c * H, D)))
                if dvb is not None:
                    dvb.index_add_(0, plan.dcols, torch.mm(pd.t(), do2))
            if sr is not None:
                pr = sr.sub_(lse_c).exp_()  # [C, H, kr]
                vg = _rows(vb, plan.ridx)
                ds = torch.bmm(do, vg.transpose(1, 2)).sub_(delta).mul_(pr)
                # empty slots point at the last row: exact zeros for a finite query, and
                # whatever a non-finite one gives lands there and is dropped
                flat = plan.ridx.reshape(-1).clamp(max=rows - 1)
                if dqc is not None:
                    dqc += torch.bmm(ds, kg)
                if dkb is not None:
                    dkb.index_add_(0, flat, torch.bmm(ds.transpose(1, 2), qs).view(-1, D))
                if dvb is not None:
                    dvb.index_add_(0, flat, torch.bmm(pr.transpose(1, 2), do).view(-1, D))
            if dq is not None:
                dq[b, t0:t1] = (dqc * scale).to(q.dtype)

    _run(len(groups), one, threads)
    for (b, _), buf in zip(groups, bufs):
        if buf is not None:
            rows, dkb, dvb = buf
            if dkb is not None:
                dkp[b, : rows - 1] += dkb[: rows - 1]
            if dvb is not None:
                dvp[b, : rows - 1] += dvb[: rows - 1]
    dk = dkp[:, :Lk].to(k.dtype).contiguous() if dkp is not None else None
    dv = dvp[:, :Lk].to(v.dtype).contiguous() if dvp is not None else None
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, strategy, chunk, threads):
        n = threads if threads is not None else torch.get_num_threads()
        out, lse = _forward(q, k, v, indices, scale, strategy, chunk, n)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.cfg = (scale, strategy, chunk)
        ctx.threads = threads
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, indices, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        threads = ctx.threads if ctx.threads is not None else torch.get_num_threads()
        dq, dk, dv = _backward(q, k, v, indices, out, lse, dout, *ctx.cfg, needs, threads)
        return dq, dk, dv, None, None, None, None, None


@register("sparse_attention", "cpu", device_types=("cpu",), priority=10)
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    strategy: str = "auto",
    chunk: int | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [B, Lk, D]; indices [B, Lq, K] int64 key positions in [0, Lk)
    (-1 = empty) -> [B, Lq, H, D]; Lq <= Lk (a query suffix under context parallelism).

    Same contract and result as the reference (per-slot: a key in two slots counts twice).
    `strategy` ("auto" | "gather" | "union"), `chunk` (queries per chunk; default from K and
    D) and `threads` (worker threads; default torch.get_num_threads() when the forward, and
    again when the backward, runs) are for tests and tuning.
    """
    _min_count(strategy, 1)  # validate early
    threads = None if threads is None else max(1, int(threads))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not grad and q.shape[1] * indices.shape[-1] < k.shape[1]:
        return _few_queries(q, k, v, indices, float(scale))
    return _SparseAttention.apply(q, k, v, indices, float(scale), strategy, chunk, threads)


def _few_queries(q, k, v, indices, scale: float) -> torch.Tensor:
    """Inference with fewer selections than keys (decoding over a KV cache): read only the
    selected rows. The chunked path pads and scans the whole of K and V (for non-finite rows)
    on every call, O(Lk) per decode step. Same semantics: an empty slot reads zeros and scores
    -inf; `where`, not arithmetic, so an unselected non-finite row never reaches a query."""
    B, Lq, H, D = q.shape
    K = indices.shape[-1]
    valid = (indices >= 0)[..., None]  # [B, Lq, K, 1]
    flat = indices.clamp(min=0).reshape(B, Lq * K, 1).expand(B, Lq * K, D)
    cdt = _compute_dtype(q.dtype)
    ks = torch.where(valid, torch.gather(k, 1, flat).view(B, Lq, K, D), 0).to(cdt)
    vs = torch.where(valid, torch.gather(v, 1, flat).view(B, Lq, K, D), 0).to(cdt)
    scores = torch.einsum("blhd,blkd->blhk", q.to(cdt), ks) * scale
    scores = scores.masked_fill(~valid[..., 0][:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # already in the compute dtype
    return torch.einsum("blhk,blkd->blhd", probs, vs).to(q.dtype)
