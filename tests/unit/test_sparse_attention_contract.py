"""The sparse-attention index contract on the reference and CPU backends (Triton and NPU:
their own test files), non-finite isolation across documents, the CPU backend's worker
threads, and the index-pattern generators' document support.

Contract: indices [B, L, K] int64, -1 = empty slot anywhere in a row; every valid slot is
one softmax term (a key selected twice by one query counts twice); empty slots contribute
nothing, so an inf/NaN in one document never reaches another document's queries or their
keys' gradients.

Tolerances: rtol = atol = 1e-4 in float32 (different summation order), as in
test_sparse_attention_cpu.py.
"""

import threading

import pytest
import torch

from wanka.ops.index_patterns import block_sparse_indices, random_indices, realistic_indices
from wanka.ops.sparse_attention import cpu, reference

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _doc_ids(B, L, cuts):
    d = torch.zeros(B, L, dtype=torch.long)
    for c in cuts:
        d[:, c:] += 1
    return d


def _check_indices(idx, doc_ids):
    """Valid slots: distinct, causal, in the query's document, the query itself among them;
    a query that sees at most K keys selects all of them."""
    B, L, K = idx.shape
    t = torch.arange(L)[None, :, None]
    valid = idx >= 0
    assert (~valid | (idx <= t)).all(), "a key from the future"
    assert (idx == t).any(-1).all(), "a query misses itself"
    s = idx.sort(-1).values
    assert not ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(), "duplicates"
    key_doc = doc_ids.gather(1, idx.clamp(min=0).view(B, -1)).view(B, L, K)
    assert (~valid | (key_doc == doc_ids[:, :, None])).all(), "a key from another document"
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    visible = (same & (torch.arange(L)[None, None, :] <= t)).sum(-1)
    few = visible <= K
    assert (valid.sum(-1)[few] == visible[few]).all(), "a short row misses a visible key"


def _shuffle_slots(idx, seed):
    g = torch.Generator().manual_seed(seed)
    return idx.gather(-1, torch.rand(idx.shape, generator=g).argsort(-1))


def _with_duplicates(idx):
    """Valid slots first (as the generators return them): repeat slot 0 (the newest key,
    in every pattern's window) over the last valid slot of rows with >= 2 valid slots, and
    over the first empty slot of rows that have one; a third copy where rows allow it."""
    idx = idx.clone()
    n = (idx >= 0).sum(-1, keepdim=True)  # [B, L, 1]
    K = idx.shape[-1]
    first = idx[..., :1]
    last = (n - 1).clamp(min=0)
    idx.scatter_(-1, last, torch.where(n >= 2, first, idx.gather(-1, last)))
    empty = n.clamp(max=K - 1)
    idx.scatter_(-1, empty, torch.where(n < K, first, idx.gather(-1, empty)))
    third = (n - 2).clamp(min=0)
    idx.scatter_(-1, third, torch.where(n >= 4, first, idx.gather(-1, third)))
    return idx


def _inputs(B, L, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, L, H, D, generator=g),
        torch.randn(B, L, D, generator=g),
        torch.randn(B, L, D, generator=g),
        torch.randn(B, L, H, D, generator=g),
    )


def _grads(fn, q, k, v, idx, scale, dout):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v, idx, scale)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


# --- duplicates: per-slot semantics -----------------------------------------------------


def test_reference_counts_a_duplicated_key_once_per_slot():
    """The definition, written out: out = sum_j c_j e^{s_j} v_j / sum_j c_j e^{s_j} over the
    distinct keys j, c_j = the number of slots holding j."""
    L, H, D = 6, 2, 4
    q, k, v, _ = _inputs(1, L, H, D, seed=0)
    idx = torch.full((1, L, 4), -1, dtype=torch.long)
    idx[0, 5] = torch.tensor([5, 2, 2, 2])  # key 2 three times, key 5 once
    idx[0, :5, 0] = torch.arange(5)
    out = reference.sparse_attention(q, k, v, idx, 0.5)
    s = torch.einsum("hd,jd->hj", q[0, 5], k[0, [5, 2]]) * 0.5
    w = torch.tensor([1.0, 3.0]) * s.exp()
    want = (w / w.sum(-1, keepdim=True)) @ v[0, [5, 2]]
    torch.testing.assert_close(out[0, 5], want, **TOL)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strategy", ["auto", "union", "gather"])
@pytest.mark.parametrize("pattern", ["realistic", "random", "block"])
def test_cpu_counts_duplicates_per_slot_like_the_reference(monkeypatch, pattern, strategy, threads):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")
    B, L, K, H, D = 2, 160, 24, 3, 8
    doc = _doc_ids(B, L, (70,))
    gen = {"realistic": realistic_indices, "random": random_indices,
           "block": block_sparse_indices}[pattern]  # fmt: skip
    kw = {"block": 4} if pattern == "block" else {}
    idx = _shuffle_slots(_with_duplicates(gen(B, L, K, doc_ids=doc, seed=1, **kw)), seed=2)
    s = idx.sort(-1).values
    assert ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(-1).float().mean() > 0.9
    q, k, v, dout = _inputs(B, L, H, D, seed=3)
    want = _grads(reference.sparse_attention, q, k, v, idx, 0.4, dout)
    for chunk in (None, 16):

        def fn(q, k, v, i, sc, chunk=chunk):
            return cpu.sparse_attention(q, k, v, i, sc, strategy=strategy, chunk=chunk,
                                        threads=threads)  # fmt: skip

        got = _grads(fn, q, k, v, idx, 0.4, dout)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


# --- non-finite values stay in their document -------------------------------------------

CUT = 60  # document 0 is positions 0 .. 59 of every row


def _planted(B, L, H, D, seed):
    """Inputs with inf/NaN in document 0 (row 0 of K and V included: what empty slots of
    the old code read), and the same inputs made finite there."""
    q, k, v, dout = _inputs(B, L, H, D, seed)
    bad = [x.clone() for x in (q, k, v)]
    bad[1][:, 0] = float("inf")
    bad[2][:, 0] = float("nan")
    bad[2][:, 7, 1] = float("-inf")
    bad[0][:, 50, 1, 2] = float("inf")  # a document-0 query in the chunk that spans the cut
    return (q, k, v), tuple(bad), dout


def _check_isolated(fn, idx, H=3, D=8):
    B, L = idx.shape[:2]
    clean, bad, dout = _planted(B, L, H, D, seed=11)
    want = _grads(reference.sparse_attention, *clean, idx, 0.4, dout)
    got = _grads(fn, *bad, idx, 0.4, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        a, b = a[:, CUT:], b[:, CUT:]  # queries / keys of the other documents
        assert torch.isfinite(a).all(), f"{name}: a non-finite value left document 0"
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert not torch.isfinite(got[0][:, :CUT]).all()  # the planted values did act in doc 0


def _doc_indices(pattern, B=2, L=150, K=20):
    doc = _doc_ids(B, L, (CUT, 110))
    if pattern == "random":
        idx = random_indices(B, L, K, doc_ids=doc, seed=4)
    else:
        idx = realistic_indices(B, L, K, doc_ids=doc, seed=4)
    _check_indices(idx, doc)
    assert (idx[:, CUT:] < 0).any()  # empty slots in the other documents' queries
    return _shuffle_slots(idx, seed=5)


@pytest.mark.parametrize("pattern", ["realistic", "random"])
def test_reference_keeps_nonfinite_values_in_their_document(pattern):
    _check_isolated(reference.sparse_attention, _doc_indices(pattern))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strategy", ["auto", "union", "gather"])
@pytest.mark.parametrize("pattern", ["realistic", "random"])
def test_cpu_keeps_nonfinite_values_in_their_document(monkeypatch, pattern, strategy, threads):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")
    idx = _doc_indices(pattern)
    for chunk in (None, 16):  # 16: a chunk holds queries of documents 0 and 1

        def fn(q, k, v, i, sc, chunk=chunk):
            return cpu.sparse_attention(q, k, v, i, sc, strategy=strategy, chunk=chunk,
                                        threads=threads)  # fmt: skip

        _check_isolated(fn, idx)


# --- worker threads ---------------------------------------------------------------------


def test_cpu_threads_run_chunks_on_single_threaded_workers(monkeypatch):
    """With threads=2 every gather runs on a worker thread whose torch ops are
    single-threaded; the caller's thread count, and the default of threads started later,
    stay as they were; results are bit-identical from run to run (no race in dK/dV)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        real = cpu._rows

        def rows(x, i):
            seen.append((threading.current_thread() is threading.main_thread(),
                         torch.get_num_threads()))  # fmt: skip
            return real(x, i)

        monkeypatch.setattr(cpu, "_rows", rows)
        B, L, K, H, D = 1, 300, 24, 2, 8
        idx = realistic_indices(B, L, K, seed=1)
        q, k, v, dout = _inputs(B, L, H, D, seed=2)

        def fn(q, k, v, i, sc):
            return cpu.sparse_attention(q, k, v, i, sc, chunk=16, threads=2)

        a = _grads(fn, q, k, v, idx, 0.3, dout)
        assert seen and all(not main and n == 1 for main, n in seen)
        assert torch.get_num_threads() == 2
        later = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2]
        b = _grads(fn, q, k, v, idx, 0.3, dout)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        seen.clear()
        one = _grads(lambda *x: cpu.sparse_attention(*x, chunk=16, threads=1), q, k, v, idx,
                     0.3, dout)  # fmt: skip
        assert seen and all(main for main, _ in seen)  # 1 thread: the caller does it all
        for x, y in zip(a, one, strict=True):
            torch.testing.assert_close(x, y, **TOL)
    finally:
        torch.set_num_threads(before)


def test_cpu_worker_errors_reach_the_caller(monkeypatch):
    def boom(x, i):
        raise RuntimeError("boom in a worker")

    monkeypatch.setattr(cpu, "_rows", boom)
    q, k, v, _ = _inputs(1, 64, 2, 8, seed=0)
    with pytest.raises(RuntimeError, match="boom in a worker"):
        cpu.sparse_attention(q, k, v, random_indices(1, 64, 8), 0.5, chunk=8, threads=2)


# --- index patterns with documents ------------------------------------------------------


@pytest.mark.parametrize("gen", [realistic_indices, random_indices, block_sparse_indices])
def test_patterns_respect_packed_documents(gen):
    B, L, K = 2, 400, 48
    doc = _doc_ids(B, L, (90, 91, 230))  # one document of a single token
    doc[1, 300:] += 1
    kw = {"block": 8} if gen is block_sparse_indices else {}
    idx = gen(B, L, K, doc_ids=doc, seed=3, **kw)
    _check_indices(idx, doc)
    # one document as ids gives what no ids gives
    zeros = torch.zeros(B, L, dtype=torch.long)
    assert torch.equal(gen(B, L, K, doc_ids=zeros, seed=3, **kw), gen(B, L, K, seed=3, **kw))


def test_realistic_indices_restart_sinks_and_window_per_document():
    L, K, cut = 300, 32, 120
    doc = _doc_ids(1, L, (cut,))
    idx = realistic_indices(1, L, K, window=16, n_heavy=4, seed=0, doc_ids=doc)[0]
    late = idx[cut + 100]  # sees 101 keys of its document: window + sinks + random
    assert set(range(cut, cut + 4)) <= set(late.tolist())  # the document's own sinks
    assert set(range(cut + 100 - 15, cut + 101)) <= set(late.tolist())  # its window
    assert int((late >= 0).sum()) == K


def test_block_sparse_indices_take_whole_aligned_blocks():
    L, K, block = 1024, 256, 64
    idx = block_sparse_indices(1, L, K, block=block, seed=0)[0]
    _check_indices(idx[None], torch.zeros(1, L, dtype=torch.long))
    t = 1023  # its window starts on a block boundary: every block below is whole
    row = idx[t][idx[t] >= 0]
    window = K // 4
    rest = row[row < t - window + 1]
    blocks = rest.div(block, rounding_mode="floor").unique()
    assert len(blocks) == (K - window) // block  # 3 blocks, each taken whole
    assert len(rest) == len(blocks) * block
    # queries of one aligned block of 64 share their key blocks (key 959 is in t - 1's window)
    other = idx[t - 1][idx[t - 1] >= 0]
    assert set(rest.tolist()) <= set(other.tolist())
