"""Query-suffix contract of the attention ops (context parallelism; wanka.ops.registry
docstring): q has Lq <= Lk tokens, k / v / doc_ids Lk, query i sits at key position
Lk - Lq + i. For every op and every backend that runs on CPU (triton through its interpreter,
TRITON_INTERPRET=1 set before triton is imported), over packed rows of several documents:

1. suffix: op(q[:, -Lq:], k, ...) == op(q, k, ...)[:, -Lq:], values and the gradients of the
   inputs (the full call's upstream gradient is zero on the queries left out), for Lq = 1,
   suffixes starting mid-document and at a document start, and Lq == Lk;
2. trimmed keys: queries [a, b) of one document starting at s, called with keys [s, b) only,
   give the full row's result (indices shifted by s);
3. registry: a backend that declines a call is skipped for the next one (logged once); a
   forced one raises ValueError; the NPU backends decline Lq < Lk.

Tolerances: float64 inputs on the torch backends (the references round the softmax through
float32): 1e-6; float32 on the triton ones: 1e-4.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402
import torch  # noqa: E402

from wanka import ops  # noqa: E402
from wanka.ops import registry  # noqa: E402
from wanka.ops.dense_attention import cpu as dense_cpu  # noqa: E402
from wanka.ops.dense_attention import probs_chunked  # noqa: E402
from wanka.ops.dense_attention import reference as dense_ref  # noqa: E402
from wanka.ops.indexer_kl import chunked as kl_chunked  # noqa: E402
from wanka.ops.indexer_kl import reference as kl_ref  # noqa: E402
from wanka.ops.lightning_indexer import cpu as li_cpu  # noqa: E402
from wanka.ops.lightning_indexer import reference as li_ref  # noqa: E402
from wanka.ops.sparse_attention import cpu as sa_cpu  # noqa: E402
from wanka.ops.sparse_attention import reference as sa_ref  # noqa: E402
from wanka.ops.triton_common import HAVE_TRITON  # noqa: E402

if HAVE_TRITON:
    from wanka.ops.dense_attention import triton as dense_tri
    from wanka.ops.lightning_indexer import triton as li_tri
    from wanka.ops.sparse_attention import triton as sa_tri

# Triton binds interpreter mode when it is imported: if another test module imported it
# first, the triton cases are rerun in a fresh interpreter by test_triton_in_subprocess.
_INTERPRETED = HAVE_TRITON and type(dense_tri._fwd_kernel).__name__ == "InterpretedFunction"
TRITON_SKIP = pytest.mark.skipif(
    not _INTERPRETED, reason="triton missing or imported before TRITON_INTERPRET"
)
TRITON = pytest.param("triton", marks=TRITON_SKIP)

B, L, H, D, HI, DI, TOPK = 2, 24, 2, 8, 2, 8, 6
# Row 0: documents [0, 3) [3, 5) [5, 14) [14, 24); row 1: [0, 11) [11, 17) [17, 24).
DOC = torch.tensor([[0] * 3 + [1] * 2 + [2] * 9 + [3] * 10, [0] * 11 + [1] * 6 + [2] * 7])
# 1 query; starts mid-document in both rows; at row 0's last document start; mid-row; all.
LQS = [1, 5, 10, 17, L]
# The interpreter is slow: 1 query, and a suffix starting at a document start in row 0 and
# mid-document in row 1 (Lq == Lk is the existing triton tests' case).
TRITON_LQS = [1, 10]


def _cases(backends: list) -> list:
    """(backend, lq) parameters: every LQS for the torch backends, TRITON_LQS for triton."""
    out = []
    for b in backends:
        name = b.values[0] if hasattr(b, "values") else b
        marks = [TRITON_SKIP] if name == "triton" else []
        for lq in TRITON_LQS if name == "triton" else LQS:
            out.append(pytest.param(name, lq, marks=marks, id=f"{name}-{lq}"))
    return out


# Row 0, queries [A, E) of the document starting at S.
S, A, E = 5, 8, 13


def _tol(backend: str) -> dict:
    return {"rtol": 1e-4, "atol": 1e-4} if backend == "triton" else {"rtol": 1e-6, "atol": 1e-6}


def _dtype(backend: str) -> torch.dtype:
    return torch.float32 if backend == "triton" else torch.float64


def _randn(*shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _grads(fn, args: list, diff: tuple[int, ...], upstream):
    """fn(*args) with args[i] for i in diff as fresh leaves -> (detached output, their grads).
    upstream(out) -> the scalar to differentiate."""
    args = list(args)
    for i in diff:
        args[i] = args[i].detach().clone().requires_grad_(True)
    out = fn(*args)
    grads = torch.autograd.grad(upstream(out), [args[i] for i in diff])
    return out, grads


def _close(a, b, tol, what):
    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")


def _zero_before(x: torch.Tensor, n: int) -> torch.Tensor:
    """x with its first n query rows zeroed (the full call's upstream gradient)."""
    x = x.clone()
    x[:, :n] = 0
    return x


# --- dense_attention ---------------------------------------------------------------------


def _dense_fn(backend: str, monkeypatch):
    if backend == "reference":
        return dense_ref.dense_attention
    if backend == "cpu":  # small groups and mask blocks: packing and straddling groups
        monkeypatch.setattr(dense_cpu, "GROUP", 4)
        monkeypatch.setattr(dense_cpu, "MASK_ELEMS", 40)
        return dense_cpu.dense_attention
    return functools.partial(dense_tri.dense_attention, block=16)


def _dense_inputs(dtype):
    q = _randn(B, L, H, D, seed=1, dtype=dtype)
    return q, _randn(B, L, D, seed=2, dtype=dtype), _randn(B, L, D, seed=3, dtype=dtype)


@pytest.mark.parametrize("backend, lq", _cases(["reference", "cpu", TRITON]))
def test_dense_attention_suffix(backend, lq, monkeypatch):
    fn, dt, tol = _dense_fn(backend, monkeypatch), _dtype(backend), _tol(backend)
    q, k, v = _dense_inputs(dt)
    g = _randn(B, L, H, D, seed=4, dtype=dt)
    full, (dq, dk, dv) = _grads(
        lambda *a: fn(*a, DOC, 0.3),
        [q, k, v],
        (0, 1, 2),
        lambda o: (o * _zero_before(g, L - lq)).sum(),
    )
    part, (pq, pk, pv) = _grads(
        lambda *a: fn(*a, DOC, 0.3), [q[:, -lq:], k, v], (0, 1, 2), lambda o: (o * g[:, -lq:]).sum()
    )
    assert part.shape == (B, lq, H, D)
    _close(part, full[:, -lq:], tol, "out")
    _close(pq, dq[:, -lq:], tol, "dq")
    _close(pk, dk, tol, "dk")
    _close(pv, dv, tol, "dv")
    if backend != "reference":  # and the suffix is right, not just self-consistent
        want = dense_ref.dense_attention(q[:, -lq:].double(), k.double(), v.double(), DOC, 0.3)
        _close(part.double(), want, tol, "out vs reference")


@pytest.mark.parametrize("backend", ["reference", "cpu", TRITON])
def test_dense_attention_trimmed_keys(backend, monkeypatch):
    fn, dt, tol = _dense_fn(backend, monkeypatch), _dtype(backend), _tol(backend)
    q, k, v = (x[:1] for x in _dense_inputs(dt))
    g = _randn(1, E - A, H, D, seed=5, dtype=dt)
    g_full = torch.zeros(1, L, H, D, dtype=dt)
    g_full[:, A:E] = g
    full, (dq, dk, dv) = _grads(
        lambda *a: fn(*a, DOC[:1], 0.3), [q, k, v], (0, 1, 2), lambda o: (o * g_full).sum()
    )
    args = [q[:, A:E], k[:, S:E], v[:, S:E]]
    part, (pq, pk, pv) = _grads(
        lambda *a: fn(*a, DOC[:1, S:E], 0.3), args, (0, 1, 2), lambda o: (o * g).sum()
    )
    _close(part, full[:, A:E], tol, "out")
    _close(pq, dq[:, A:E], tol, "dq")
    _close(pk, dk[:, S:E], tol, "dk")
    _close(pv, dv[:, S:E], tol, "dv")
    assert not dk[:, :S].any() and not dk[:, E:].any()  # nothing outside the document


# --- attention_probs ---------------------------------------------------------------------


def _probs_fn(backend: str):
    if backend == "reference":
        return dense_ref.attention_probs
    return functools.partial(probs_chunked.attention_probs, chunk_size=3)


def _selected(q, k, w, doc):
    with torch.no_grad():
        return li_ref.lightning_indexer(q, k, w, doc, TOPK)[0]


def _indexer_inputs(dtype, seed=10):
    """ReLU ties: k > 0 and each (query, head) q all-positive or all-negative, so a query
    whose heads are all negative scores every key exactly 0 (the tie rule decides)."""
    q = _randn(B, L, HI, DI, seed=seed, dtype=dtype).abs()
    sign = torch.randint(0, 2, (B, L, HI, 1), generator=torch.Generator().manual_seed(seed))
    q = torch.where(sign.bool(), q, -q)
    k = _randn(B, L, DI, seed=seed + 1, dtype=dtype).abs()
    w = _randn(B, L, HI, seed=seed + 2, dtype=dtype).abs() + 0.1
    return q, k, w


@pytest.mark.parametrize("backend, lq", _cases(["reference", "chunked"]))
def test_attention_probs_suffix(backend, lq):
    fn = _probs_fn(backend)
    q, k, _ = _dense_inputs(torch.float64)
    idx = _selected(*_indexer_inputs(torch.float64), DOC)
    full = fn(q, k, DOC, 0.3)
    part = fn(q[:, -lq:], k, DOC, 0.3)
    assert part.shape == (B, lq, L)
    _close(part, full[:, -lq:], _tol(backend), "over visible keys")
    full = fn(q, k, DOC, 0.3, indices=idx)
    part = fn(q[:, -lq:], k, DOC, 0.3, indices=idx[:, -lq:])
    assert part.shape == (B, lq, TOPK)
    _close(part, full[:, -lq:], _tol(backend), "over selected keys")


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_attention_probs_trimmed_keys(backend):
    fn = _probs_fn(backend)
    q, k, _ = (x[:1] for x in _dense_inputs(torch.float64))
    full = fn(q, k, DOC[:1], 0.3)
    part = fn(q[:, A:E], k[:, S:E], DOC[:1, S:E], 0.3)
    _close(part, full[:, A:E, S:E], _tol(backend), "over visible keys")
    assert not full[:, A:E, :S].any() and not full[:, A:E, E:].any()
    idx = _selected(*(x[:1] for x in _indexer_inputs(torch.float64)), DOC[:1])[:, A:E]
    shifted = torch.where(idx >= 0, idx - S, idx)
    full = fn(q[:, A:E], k, DOC[:1], 0.3, indices=idx)
    part = fn(q[:, A:E], k[:, S:E], DOC[:1, S:E], 0.3, indices=shifted)
    _close(part, full, _tol(backend), "over selected keys")


# --- lightning_indexer / indexer_scores ----------------------------------------------------


def _indexer_fn(backend: str, monkeypatch):
    if backend == "reference":
        return li_ref.lightning_indexer
    if backend.startswith("cpu"):  # both backward paths
        ratio = 1e9 if backend == "cpu-dense-bwd" else 0.0
        monkeypatch.setattr(li_cpu, "BWD_DENSE_RATIO", ratio)
        return functools.partial(li_cpu.lightning_indexer, chunk_size=4)
    return functools.partial(li_tri.lightning_indexer, chunk_size=4, block=16)


def _canon(idx, val):
    """Slots sorted by key index: the selected set and its scores, whatever the slot order
    (backends may list equal scores in another order)."""
    idx, order = idx.sort(dim=-1, stable=True)
    return idx, val.gather(-1, order)


def _indexer_run(fn, q, k, w, doc, r):
    """-> (canonical indices, scores, grads of sum(scores * r) over valid slots w.r.t. q, k, w)."""
    out = {}

    def call(q, k, w):
        out["idx"], val = _canon(*fn(q, k, w, doc, TOPK))
        out["val"] = val.detach()
        return val.masked_fill(out["idx"] < 0, 0.0)

    _, grads = _grads(call, [q, k, w], (0, 1, 2), lambda v: (v * r).sum())
    return out["idx"], out["val"], grads


def _same_scores(a, b, tol, what):
    assert torch.equal(torch.isinf(a), torch.isinf(b)), what
    _close(a.masked_fill(torch.isinf(a), 0), b.masked_fill(torch.isinf(b), 0), tol, what)


INDEXER_BACKENDS = ["reference", "cpu-dense-bwd", "cpu-sparse-bwd", TRITON]


@pytest.mark.parametrize("backend, lq", _cases(INDEXER_BACKENDS))
def test_lightning_indexer_suffix(backend, lq, monkeypatch):
    fn, dt, tol = _indexer_fn(backend, monkeypatch), _dtype(backend), _tol(backend)
    q, k, w = _indexer_inputs(dt)
    r = _randn(B, L, TOPK, seed=12, dtype=dt)
    idx, val, (dq, dk, dw) = _indexer_run(fn, q, k, w, DOC, _zero_before(r, L - lq))
    pidx, pval, (pq, pk, pw) = _indexer_run(fn, q[:, -lq:], k, w[:, -lq:], DOC, r[:, -lq:])
    assert pidx.shape == (B, lq, TOPK) and bool((pidx < L).all())
    assert torch.equal(pidx, idx[:, -lq:]), "selected sets differ"
    ridx, _ = _canon(*_selected_pair(q, k, w, DOC))
    assert torch.equal(pidx, ridx[:, -lq:]), "selected sets differ from the reference's"
    _same_scores(pval, val[:, -lq:], tol, "scores")
    _close(pq, dq[:, -lq:], tol, "dq")
    _close(pk, dk, tol, "dk")
    _close(pw, dw[:, -lq:], tol, "dw")


def _selected_pair(q, k, w, doc):
    with torch.no_grad():
        return li_ref.lightning_indexer(q.double(), k.double(), w.double(), doc, TOPK)


@pytest.mark.parametrize("backend", INDEXER_BACKENDS)
def test_lightning_indexer_trimmed_keys(backend, monkeypatch):
    fn, dt, tol = _indexer_fn(backend, monkeypatch), _dtype(backend), _tol(backend)
    q, k, w = (x[:1] for x in _indexer_inputs(dt, seed=20))
    r = _randn(1, E - A, TOPK, seed=21, dtype=dt)
    r_full = torch.zeros(1, L, TOPK, dtype=dt)
    r_full[:, A:E] = r
    idx, val, (dq, dk, dw) = _indexer_run(fn, q, k, w, DOC[:1], r_full)
    pidx, pval, (pq, pk, pw) = _indexer_run(fn, q[:, A:E], k[:, S:E], w[:, A:E], DOC[:1, S:E], r)
    assert (pidx < 0).any() and (pidx >= 0).any()  # early queries see fewer than TOPK keys
    assert torch.equal(torch.where(pidx >= 0, pidx + S, pidx), idx[:, A:E])
    _same_scores(pval, val[:, A:E], tol, "scores")
    _close(pq, dq[:, A:E], tol, "dq")
    _close(pk, dk[:, S:E], tol, "dk")
    _close(pw, dw[:, A:E], tol, "dw")


def test_indexer_ties_are_exercised():
    """The inputs above do have queries whose every score is an exact 0 tie."""
    q, k, w = _indexer_inputs(torch.float64)
    scores = li_ref.indexer_scores(q, k, w, DOC)
    visible = torch.isfinite(scores)
    all_zero = ((scores == 0) | ~visible).all(-1) & (visible.sum(-1) > TOPK)
    assert all_zero.any()


@pytest.mark.parametrize("lq", LQS)
def test_indexer_scores_suffix(lq):
    q, k, w = _indexer_inputs(torch.float64)
    g = _randn(B, L, L, seed=13, dtype=torch.float64)

    def upstream(n_skip, g):
        return lambda s: (s.masked_fill(torch.isinf(s), 0) * _zero_before(g, n_skip)).sum()

    fn = functools.partial(li_ref.indexer_scores, doc_ids=DOC)
    full, (dq, dk, dw) = _grads(fn, [q, k, w], (0, 1, 2), upstream(L - lq, g))
    part, (pq, pk, pw) = _grads(fn, [q[:, -lq:], k, w[:, -lq:]], (0, 1, 2), upstream(0, g[:, -lq:]))
    assert part.shape == (B, lq, L)
    assert torch.equal(part, full[:, -lq:])
    tol = _tol("reference")
    _close(pq, dq[:, -lq:], tol, "dq")
    _close(pk, dk, tol, "dk")
    _close(pw, dw[:, -lq:], tol, "dw")


# --- indexer_kl ----------------------------------------------------------------------------


def _kl_fn(backend: str):
    if backend == "reference":
        return kl_ref.indexer_kl
    return functools.partial(kl_chunked.indexer_kl, chunk_size=3)


def _kl_rows(q, k, qi, ki, wi, doc, rows: slice):
    """The reference's KL summed over the queries `rows` of full-row calls (the truth a
    scalar op can be compared with)."""
    scores = li_ref.indexer_scores(qi, ki, wi, doc)[:, rows]
    target = dense_ref.attention_probs(q, k, doc, 0.3)[:, rows]
    return kl_ref.kl_sum(target, scores)


def _kl_inputs():
    q, k, _ = _dense_inputs(torch.float64)
    qi, ki, wi = _indexer_inputs(torch.float64, seed=30)
    return q, k, qi, ki, wi


@pytest.mark.parametrize("backend, lq", _cases(["reference", "chunked"]))
def test_indexer_kl_suffix(backend, lq):
    fn = _kl_fn(backend)
    q, k, qi, ki, wi = _kl_inputs()
    rows = slice(L - lq, L)
    want, (dq, dk, dw) = _grads(
        lambda *a: _kl_rows(q, k, *a, DOC, rows), [qi, ki, wi], (0, 1, 2), lambda x: x
    )
    args = [q[:, rows], k, qi[:, rows], ki, wi[:, rows]]
    got, (pq, pk, pw) = _grads(lambda *a: fn(*a, DOC, 0.3), args, (2, 3, 4), lambda x: x)
    tol = _tol(backend)
    _close(got, want, tol, "KL")
    _close(pq, dq[:, rows], tol, "dqi")
    _close(pk, dk, tol, "dki")
    _close(pw, dw[:, rows], tol, "dwi")
    if lq == L:
        _close(got, fn(q, k, qi, ki, wi, DOC, 0.3), tol, "KL of the whole row")


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_indexer_kl_trimmed_keys(backend):
    fn = _kl_fn(backend)
    q, k, qi, ki, wi = (x[:1] for x in _kl_inputs())
    want, (dq, dk, dw) = _grads(
        lambda *a: _kl_rows(q, k, *a, DOC[:1], slice(A, E)), [qi, ki, wi], (0, 1, 2), lambda x: x
    )
    args = [q[:, A:E], k[:, S:E], qi[:, A:E], ki[:, S:E], wi[:, A:E]]
    got, (pq, pk, pw) = _grads(lambda *a: fn(*a, DOC[:1, S:E], 0.3), args, (2, 3, 4), lambda x: x)
    tol = _tol(backend)
    _close(got, want, tol, "KL")
    _close(pq, dq[:, A:E], tol, "dqi")
    _close(pk, dk[:, S:E], tol, "dki")
    _close(pw, dw[:, A:E], tol, "dwi")


# --- sparse_attention ----------------------------------------------------------------------


def _sparse_fn(backend: str):
    if backend == "reference":
        return sa_ref.sparse_attention
    if backend.startswith("cpu-"):
        return functools.partial(sa_cpu.sparse_attention, strategy=backend[4:], chunk=3)
    return functools.partial(sa_tri.sparse_attention, block_k=16)


SPARSE_BACKENDS = ["reference", "cpu-auto", "cpu-gather", "cpu-union", TRITON]


@pytest.mark.parametrize("backend, lq", _cases(SPARSE_BACKENDS))
def test_sparse_attention_suffix(backend, lq):
    fn, dt, tol = _sparse_fn(backend), _dtype(backend), _tol(backend)
    q, k, v = _dense_inputs(dt)
    idx = _selected(*_indexer_inputs(torch.float64), DOC)
    assert (idx < 0).any()  # empty slots: they read the zero row Lk
    g = _randn(B, L, H, D, seed=6, dtype=dt)
    full, (dq, dk, dv) = _grads(
        lambda *a: fn(*a, idx, 0.3),
        [q, k, v],
        (0, 1, 2),
        lambda o: (o * _zero_before(g, L - lq)).sum(),
    )
    part, (pq, pk, pv) = _grads(
        lambda *a: fn(*a, idx[:, -lq:], 0.3), [q[:, -lq:], k, v], (0, 1, 2),
        lambda o: (o * g[:, -lq:]).sum(),
    )  # fmt: skip
    assert part.shape == (B, lq, H, D)
    _close(part, full[:, -lq:], tol, "out")
    _close(pq, dq[:, -lq:], tol, "dq")
    _close(pk, dk, tol, "dk")
    _close(pv, dv, tol, "dv")


@pytest.mark.parametrize("backend", SPARSE_BACKENDS)
def test_sparse_attention_trimmed_keys(backend):
    fn, dt, tol = _sparse_fn(backend), _dtype(backend), _tol(backend)
    q, k, v = (x[:1] for x in _dense_inputs(dt))
    idx = _selected(*(x[:1] for x in _indexer_inputs(torch.float64)), DOC[:1])[:, A:E]
    shifted = torch.where(idx >= 0, idx - S, idx)
    g = _randn(1, E - A, H, D, seed=7, dtype=dt)
    full, (dq, dk, dv) = _grads(
        lambda *a: fn(*a, idx, 0.3), [q[:, A:E], k, v], (0, 1, 2), lambda o: (o * g).sum()
    )
    part, (pq, pk, pv) = _grads(
        lambda *a: fn(*a, shifted, 0.3), [q[:, A:E], k[:, S:E], v[:, S:E]], (0, 1, 2),
        lambda o: (o * g).sum(),
    )  # fmt: skip
    _close(part, full, tol, "out")
    _close(pq, dq, tol, "dq")
    _close(pk, dk[:, S:E], tol, "dk")
    _close(pv, dv[:, S:E], tol, "dv")


@pytest.mark.parametrize("backend", SPARSE_BACKENDS)
def test_sparse_attention_empty_slots_never_read_a_key_row(backend):
    """With Lq < Lk an empty slot must read the zero row Lk, not key row Lq: inf in K/V row
    Lq (a document the queries cannot see) leaves the output finite and unchanged."""
    fn, dt = _sparse_fn(backend), _dtype(backend)
    lq = 5  # row 0: queries 19 .. 23 in the document [14, 24); key row 5 is in [5, 14)
    q, k, v = (x[:1] for x in _dense_inputs(dt))
    idx = _selected(*(x[:1] for x in _indexer_inputs(torch.float64)), DOC[:1])[:, -lq:]
    idx[:, :, -2:] = -1  # empty slots in every row
    assert not (idx == lq).any()
    clean = fn(q[:, -lq:], k, v, idx, 0.3)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, lq], v_bad[:, lq] = float("inf"), float("inf")
    got = fn(q[:, -lq:], k_bad, v_bad, idx, 0.3)
    assert torch.isfinite(got).all()
    _close(got, clean, _tol(backend), "out")


# --- registry ------------------------------------------------------------------------------


@pytest.fixture
def scratch_op(monkeypatch):
    """Op `scratch_attend` with a reference and a higher-priority `fast` backend that
    declines query suffixes."""
    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    calls = []

    def backend(name):
        def fn(q, k):
            calls.append(name)
            return q.sum() + k.sum()

        return fn

    registry.register("scratch_attend", "reference")(backend("reference"))
    registry.register(
        "scratch_attend",
        "fast",
        device_types=("cpu",),
        priority=10,
        supports=registry.query_suffix_unsupported,
    )(backend("fast"))
    yield calls
    registry._REGISTRY.pop("scratch_attend", None)
    registry._LOGGED.difference_update({x for x in registry._LOGGED if x[0] == "scratch_attend"})


def test_registry_skips_a_backend_that_declines(scratch_op, caplog):
    q, k = torch.ones(1, 4, 2), torch.ones(1, 6, 2)
    assert registry.select("scratch_attend", "cpu").name == "fast"
    registry.call("scratch_attend", q, k[:, :4])
    assert scratch_op == ["fast"]
    with caplog.at_level(logging.WARNING, logger="wanka.ops.registry"):
        for _ in range(2):
            registry.call("scratch_attend", q, k)
    assert scratch_op == ["fast", "reference", "reference"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # once per (op, backend, reason)
    assert "scratch_attend" in lines[0] and "'fast'" in lines[0] and "Lq < Lk" in lines[0]


def test_registry_forced_backend_that_declines_raises(scratch_op, monkeypatch):
    q, k = torch.ones(1, 4, 2), torch.ones(1, 6, 2)
    monkeypatch.setenv(registry.ENV_OVERRIDE, "scratch_attend=fast")
    with pytest.raises(ValueError, match=r"'scratch_attend'.*'fast'.*Lq < Lk"):
        registry.call("scratch_attend", q, k)
    registry.call("scratch_attend", q, k[:, :4])  # a call it can handle still runs
    monkeypatch.setenv(registry.ENV_OVERRIDE, "scratch_attend=reference")
    registry.call("scratch_attend", q, k)
    assert scratch_op == ["fast", "reference"]


def test_registry_raises_when_no_backend_can_handle_the_call(scratch_op):
    registry.register(
        "scratch_attend", "reference", supports=lambda *a: "never"
    )(lambda q, k: None)  # fmt: skip
    with pytest.raises(ValueError, match="no backend on cpu can handle"):
        registry.call("scratch_attend", torch.ones(1, 4, 2), torch.ones(1, 6, 2))


def test_npu_backends_decline_query_suffixes():
    """The fused NPU ops are not mapped for Lq < Lk: their `supports` declines (the registry
    then takes the reference), even for inputs inside every other limit."""
    bf = torch.bfloat16
    q, k, w = torch.zeros(1, 3, 64, 128, dtype=bf), torch.zeros(1, 8, 128, dtype=bf), None
    w = torch.zeros(1, 3, 64, dtype=bf)
    doc = torch.zeros(1, 8, dtype=torch.long)
    li = registry.backends("lightning_indexer")["npu"]
    assert "Lq < Lk" in li.declines((q, k, w, doc, 4), {})
    assert li.declines((q, k[:, :3], w, doc[:, :3], 4), {}) is None
    sq, kv = torch.zeros(1, 3, 4, 512, dtype=bf), torch.zeros(1, 8, 512, dtype=bf)
    idx = torch.zeros(1, 3, 4, dtype=torch.long)
    sa = registry.backends("sparse_attention")["npu"]
    assert "Lq < Lk" in sa.declines((sq, kv, kv, idx, 0.1), {})
    assert sa.declines((sq, kv[:, :3], kv[:, :3], idx, 0.1), {}) is None


def test_model_path_through_registry_on_cpu(monkeypatch):
    """ops.call with a query suffix on CPU: the cpu backends take it and agree with the
    references."""
    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    q, k, v = (x.float() for x in _dense_inputs(torch.float64))
    lq = 10
    got = ops.call("dense_attention", q[:, -lq:], k, v, DOC, 0.3)
    want = dense_ref.dense_attention(q[:, -lq:], k, v, DOC, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    qi, ki, wi = (x.float() for x in _indexer_inputs(torch.float64))
    idx, _ = ops.call("lightning_indexer", qi[:, -lq:], ki, wi[:, -lq:], DOC, TOPK)
    got = ops.call("sparse_attention", q[:, -lq:], k, v, idx, 0.3)
    want = sa_ref.sparse_attention(q[:, -lq:], k, v, idx, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_more_queries_than_keys_is_refused():
    q, k, v = _dense_inputs(torch.float64)
    with pytest.raises(ValueError, match="suffix of the keys"):
        dense_cpu.dense_attention(q, k[:, :5], v[:, :5], DOC[:, :5], 0.3)


def test_triton_in_subprocess():
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    if _INTERPRETED:
        pytest.skip("the triton cases ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
