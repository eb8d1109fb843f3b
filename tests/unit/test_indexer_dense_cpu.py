"""CPU backends of lightning_indexer (chunked) and dense_attention (SDPA) vs the references."""

from __future__ import annotations

import pytest
import torch

from wanka import ops
from wanka.ops.dense_attention import cpu as dense_cpu
from wanka.ops.dense_attention import reference as dense_ref
from wanka.ops.lightning_indexer import cpu as idx_cpu
from wanka.ops.lightning_indexer import reference as idx_ref

TOL = dict(rtol=1e-4, atol=1e-4)  # fp32


@pytest.fixture(params=["dense_bwd", "sparse_bwd"])
def bwd_path(monkeypatch, request):
    """Run an indexer test with each backward path (see lightning_indexer/cpu.py)."""
    monkeypatch.setattr(idx_cpu, "BWD_DENSE_RATIO", 1e9 if request.param == "dense_bwd" else 0.0)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")
    monkeypatch.delenv("WANKA_OPS_BACKEND", raising=False)


def make_docs(B: int, L: int, n_docs: int) -> torch.Tensor:
    """Non-decreasing doc ids with n_docs random-length runs per row (rows differ)."""
    rows = []
    for _ in range(B):
        cuts = torch.randperm(L - 1)[: n_docs - 1] + 1 if n_docs > 1 else torch.empty(0)
        d = torch.zeros(L, dtype=torch.long)
        for c in cuts.tolist():
            d[c:] += 1
        rows.append(d)
    return torch.stack(rows)


def indexer_inputs(B, L, Hi, Di, positive=False):
    q = torch.randn(B, L, Hi, Di)
    k = torch.randn(B, L, Di)
    w = torch.randn(B, L, Hi)
    if positive:
        # k >= 0, head 0 of q >= 0 and w > 0: every score > 0 (no exact-zero ties at the cut),
        # while the other heads stay signed so the ReLU gate is exercised in backward.
        k, w = k.abs(), w.abs() + 0.1
        q[:, :, 0] = q[:, :, 0].abs()
    return [t.requires_grad_() for t in (q, k, w)]


# (B, L, Hi, Di, topk, n_docs, chunk)
INDEXER_CASES = [
    (2, 37, 4, 8, 24, 1, 5),  # odd L, topk not a power of two, topk > visible for early rows
    (2, 130, 3, 16, 24, 3, 16),  # several documents, chunk crossing document boundaries
    (1, 20, 2, 8, 32, 2, None),  # topk > L: padding, default chunk
    (2, 64, 4, 8, 7, 5, 9),
]


def _check_indexer(B, L, Hi, Di, topk, n_docs, chunk, positive):
    doc = make_docs(B, L, n_docs)
    q, k, w = indexer_inputs(B, L, Hi, Di, positive)
    idx_r, val_r = idx_ref.lightning_indexer(q, k, w, doc, topk)
    idx_c, val_c = idx_cpu.lightning_indexer(q, k, w, doc, topk, chunk_size=chunk)
    assert idx_c.shape == val_c.shape == (B, L, topk) and idx_c.dtype == torch.int64
    assert not torch.isnan(val_c).any() and bool((idx_c >= -1).all())
    # Empty slots agree: -1 exactly where -inf, same count per row as the reference.
    assert torch.equal(idx_c < 0, torch.isinf(val_c))
    assert torch.equal((idx_c >= 0).sum(-1), (idx_r >= 0).sum(-1))
    # Selected values: sorted descending and equal to the reference's (tie-invariant).
    torch.testing.assert_close(val_c, val_r, **TOL)
    # Each selected index is visible and its true score is the returned score: so the
    # returned set is a true top-k of the visible scores.
    full = idx_ref.indexer_scores(q, k, w, doc).detach()
    got = torch.gather(full, 2, idx_c.clamp(min=0))
    valid = idx_c >= 0
    assert torch.isfinite(got[valid]).all()
    torch.testing.assert_close(got[valid], val_c.detach()[valid], **TOL)
    for row_c, row_r in zip(idx_c.reshape(-1, topk), idx_r.reshape(-1, topk)):
        sc = row_c[row_c >= 0]
        assert sc.unique().numel() == sc.numel()
        assert set(sc.tolist()) == set(row_r[row_r >= 0].tolist())  # same tie rule
    # Gradients of sum(scores * r) over valid slots.
    r = torch.randn(B, L, topk)
    loss_r = (val_r.masked_fill(idx_r < 0, 0) * r).sum()
    # Reorder r to follow the backend's slot order by matching indices per row.
    pos = (idx_c[..., :, None] == idx_r[..., None, :]) & (idx_c >= 0)[..., None]
    r_c = (pos.to(r.dtype) * r[..., None, :]).sum(-1)
    loss_c = (val_c.masked_fill(idx_c < 0, 0) * r_c).sum()
    g_r = torch.autograd.grad(loss_r, (q, k, w))
    g_c = torch.autograd.grad(loss_c, (q, k, w))
    for name, a, b in zip("qkw", g_c, g_r):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("case", INDEXER_CASES)
@pytest.mark.usefixtures("bwd_path")
def test_indexer_matches_reference_no_ties(case):
    _check_indexer(*case, positive=True)


@pytest.mark.usefixtures("bwd_path")
@pytest.mark.parametrize("case", INDEXER_CASES)
def test_indexer_matches_reference_with_ties(case):
    """Signed inputs give many exact-zero scores (ReLU of every head is 0): the tie rule (most
    recent key wins) must pick the reference's set."""
    _check_indexer(*case, positive=False)


def test_indexer_ties_prefer_recent_keys():
    """All scores equal (w = 0): every query keeps its k most recent visible keys."""
    B, L, Hi, Di, topk = 1, 40, 2, 4, 6
    doc = torch.tensor([[0] * 15 + [1] * 25])
    q, k, w = indexer_inputs(B, L, Hi, Di)
    w = torch.zeros(B, L, Hi)
    idx_c, val_c = idx_cpu.lightning_indexer(q, k, w, doc, topk, chunk_size=7)
    idx_r, _ = idx_ref.lightning_indexer(q, k, w, doc, topk)
    assert torch.equal(idx_c.sort(-1).values, idx_r.sort(-1).values)  # same set per row
    assert set(idx_c[0, 30].tolist()) == set(range(25, 31))
    assert set(idx_c[0, 16].tolist()) == {15, 16, -1}


@pytest.mark.usefixtures("bwd_path")
def test_indexer_grad_flows_only_to_requested_inputs():
    B, L, Hi, Di = 1, 33, 2, 8
    doc = make_docs(B, L, 2)
    q, k, w = indexer_inputs(B, L, Hi, Di, positive=True)
    k = k.detach()
    _, val = idx_cpu.lightning_indexer(q, k, w, doc, 8, chunk_size=4)
    val.masked_fill(torch.isinf(val), 0).sum().backward()
    assert q.grad is not None and w.grad is not None and k.grad is None
    assert torch.isfinite(q.grad).all() and torch.isfinite(w.grad).all()
    with torch.no_grad():
        idx, _ = ops.call("lightning_indexer", q, k, w, doc, 8)
    assert idx.shape == (B, L, 8)


@pytest.mark.parametrize("bwd_path", ["dense", "sparse"])
def test_indexer_never_scores_full_matrix(monkeypatch, bwd_path):
    """Every score tile has at most `chunk` query rows and only keys from the chunk's first
    document start up to its last query; backward works on chunk-sized tiles too."""
    B, L, Hi, Di, topk, chunk = 2, 96, 2, 8, 10, 16
    doc = make_docs(B, L, 4)
    q, k, w = indexer_inputs(B, L, Hi, Di, positive=True)
    shapes, gathers, mms = [], [], []
    real_scores, real_gather, real_mm = idx_cpu._chunk_scores, idx_cpu._gather_keys, torch.matmul

    def spy_scores(q_c, k_s, w_c):
        out = real_scores(q_c, k_s, w_c)
        shapes.append(tuple(out.shape))
        return out

    def spy_gather(k_row, ic):
        out = real_gather(k_row, ic)
        gathers.append(tuple(out.shape))
        return out

    def spy_mm(a, b):
        mms.append((tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b)

    monkeypatch.setattr(idx_cpu, "_chunk_scores", spy_scores)
    monkeypatch.setattr(idx_cpu, "_gather_keys", spy_gather)
    monkeypatch.setattr(idx_cpu, "_matmul", spy_mm)
    monkeypatch.setattr(idx_cpu, "CHUNK_ELEMS", chunk * topk * (Di + Hi))  # sparse bwd: 16
    monkeypatch.setattr(idx_cpu, "BWD_DENSE_RATIO", 1e9 if bwd_path == "dense" else 0.0)
    _, val = idx_cpu.lightning_indexer(q, k, w, doc, topk, chunk_size=chunk)
    n_fwd = len(mms)
    val.masked_fill(torch.isinf(val), 0).sum().backward()
    assert len(shapes) == n_fwd == B * (L // chunk)
    assert all(c <= chunk for c, _ in shapes)
    starts = idx_cpu._doc_starts(doc)
    for i, (c, s) in enumerate(shapes):  # span = chunk end - doc start of its first query
        b, t0 = divmod(i, L // chunk)
        t0 *= chunk
        assert s == t0 + c - int(starts[b, t0])
    assert all(a[0] <= chunk * Hi and a[1] <= L and b[1] <= L for a, b in mms)
    if bwd_path == "dense":
        assert len(mms) == 3 * n_fwd and not gathers
    else:
        assert len(mms) == n_fwd and gathers
        assert all(c <= chunk and kk <= topk for c, kk, _ in gathers)


def test_registry_picks_cpu_backends_and_env_forces_reference(monkeypatch):
    assert ops.select("lightning_indexer", "cpu").name == "cpu"
    assert ops.select("dense_attention", "cpu").name == "cpu"
    monkeypatch.setenv("WANKA_OPS_BACKEND", "lightning_indexer=reference,dense_attention=reference")
    assert ops.select("lightning_indexer", "cpu").name == "reference"
    assert ops.select("dense_attention", "cpu").name == "reference"


def test_doc_ids_must_be_non_decreasing():
    q, k, w = indexer_inputs(1, 8, 2, 4)
    doc = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]])
    with pytest.raises(ValueError):
        idx_cpu.lightning_indexer(q, k, w, doc, 4)
    with pytest.raises(ValueError):
        dense_cpu.dense_attention(torch.randn(1, 8, 2, 4), k, k, doc, 0.5)


# (B, L, H, D, n_docs, group)
DENSE_CASES = [
    (2, 37, 4, 8, 1, 256),  # single document: one is_causal call
    (2, 130, 3, 16, 3, 256),  # several documents, packed into masked groups
    (2, 130, 3, 16, 3, 8),  # long documents alone, short ones grouped
    (1, 64, 2, 8, 40, 4),  # many tiny documents (length-1 ones included)
]


@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_attention_matches_reference(case, monkeypatch):
    B, L, H, D, n_docs, group = case
    monkeypatch.setattr(dense_cpu, "GROUP", group)
    doc = make_docs(B, L, n_docs)
    q = torch.randn(B, L, H, D, requires_grad=True)
    k = torch.randn(B, L, D, requires_grad=True)
    v = torch.randn(B, L, D, requires_grad=True)
    scale = D**-0.5
    out_r = dense_ref.dense_attention(q, k, v, doc, scale)
    out_c = dense_cpu.dense_attention(q, k, v, doc, scale)
    assert out_c.shape == (B, L, H, D)
    torch.testing.assert_close(out_c, out_r, **TOL)
    r = torch.randn_like(out_r)
    g_r = torch.autograd.grad((out_r * r).sum(), (q, k, v))
    g_c = torch.autograd.grad((out_c * r).sum(), (q, k, v))
    for name, a, b in zip("qkv", g_c, g_r):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"d{n}: {m}")
