"""Triton lightning-indexer backend vs the reference, run on CPU tensors through the Triton
interpreter (TRITON_INTERPRET=1, set before triton is imported): selected index sets and
scores, and the q/k/w gradients of a loss over the selected scores, with odd lengths, k not a
power of two, k larger than the visible keys (empty -1 / -inf slots and padding past L),
several documents per row, exact-zero ties (most recent key wins), chunks and tiles crossing
document boundaries, non-contiguous inputs, poisoned outputs; and that no score tile is
bigger than one chunk of queries.

Tolerances: rtol = atol = 1e-4 on scores, 1e-3 on gradients, float32 (both sides float32,
different summation order).
"""

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from wanka import ops  # noqa: E402
from wanka.ops.lightning_indexer import reference  # noqa: E402
from wanka.ops.lightning_indexer import triton as tb  # noqa: E402

# Triton binds interpreter mode when it is imported (its own tl helpers are jit functions
# too). If another test module imported wanka.ops (hence triton) first, these tests cannot
# run in this process: test_in_subprocess reruns this file alone in a fresh interpreter.
_INTERPRETED = type(tb._scores_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not _INTERPRETED, reason="triton imported before TRITON_INTERPRET; see test_in_subprocess"
)

VAL_TOL = {"rtol": 1e-4, "atol": 1e-4}
GRAD_TOL = {"rtol": 1e-3, "atol": 1e-3}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")


def _docs(B, L, cuts):
    """[B, L] non-decreasing doc ids; row b's boundaries are `cuts` shifted by b."""
    d = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for c in cuts:
            d[b, min(L - 1, c + b) :] += 1
    return d


def _inputs(B, L, Hi, Di, positive, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, Hi, Di, generator=g)
    k = torch.randn(B, L, Di, generator=g)
    w = torch.randn(B, L, Hi, generator=g)
    if positive:  # every score > 0: no exact ties at the cut; other heads keep the ReLU gate
        k, w = k.abs(), w.abs() + 0.1
        q[:, :, 0] = q[:, :, 0].abs()
    return q, k, w


def _check(q, k, w, doc, topk, chunk, block):
    B, L = doc.shape
    leaves = [x.detach().requires_grad_(True) for x in (q, k, w)]
    idx_t, val_t = tb._TritonIndexer.apply(*leaves, doc, topk, chunk, block)
    ref_leaves = [x.detach().requires_grad_(True) for x in (q, k, w)]
    idx_r, val_r = reference.lightning_indexer(*ref_leaves, doc, topk)

    assert idx_t.shape == val_t.shape == (B, L, topk) and idx_t.dtype == torch.int64
    assert not torch.isnan(val_t).any() and bool((idx_t >= -1).all())
    assert torch.equal(idx_t < 0, torch.isinf(val_t))  # -1 exactly where -inf
    torch.testing.assert_close(val_t, val_r, **VAL_TOL)  # sorted, same values
    for row_t, row_r in zip(idx_t.reshape(-1, topk), idx_r.reshape(-1, topk), strict=True):
        sel = row_t[row_t >= 0]
        assert sel.unique().numel() == sel.numel()
        assert set(sel.tolist()) == set(row_r[row_r >= 0].tolist())  # same set, same tie rule

    # Gradients of sum(scores * r) over the valid slots; r follows each backend's slot order.
    r = torch.randn(B, L, topk, generator=torch.Generator().manual_seed(11))
    loss_r = (val_r.masked_fill(idx_r < 0, 0) * r).sum()
    pos = (idx_t[..., :, None] == idx_r[..., None, :]) & (idx_t >= 0)[..., None]
    r_t = (pos.to(r.dtype) * r[..., None, :]).sum(-1)
    loss_t = (val_t.masked_fill(idx_t < 0, 0) * r_t).sum()
    g_r = torch.autograd.grad(loss_r, ref_leaves)
    g_t = torch.autograd.grad(loss_t, leaves)
    for name, a, b in zip("qkw", g_t, g_r, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has non-finite values"
        torch.testing.assert_close(a, b, **GRAD_TOL, msg=lambda m, n=name: f"d{n}: {m}")
    return idx_t


CASES = [  # B, L, Hi, Di, topk, cuts, chunk, block
    (2, 37, 3, 8, 11, (), 16, 16),  # odd L, k not a power of two, several tiles per chunk
    (2, 45, 2, 16, 24, (9, 30), 13, 16),  # 3 documents, chunks crossing document starts
    (1, 20, 2, 8, 32, (7,), None, None),  # k > L: padded slots, default chunk and tiles
]


@needs_interpreter
@pytest.mark.parametrize("positive", [True, False], ids=["no_ties", "zero_ties"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[1]}-H{c[2]}-D{c[3]}-k{c[4]}")
def test_matches_reference(case, positive):
    B, L, Hi, Di, topk, cuts, chunk, block = case
    q, k, w = _inputs(B, L, Hi, Di, positive, seed=L)
    doc = _docs(B, L, cuts)
    idx = _check(q, k, w, doc, topk, chunk, block)
    assert (idx < 0).any()  # early queries of each document see fewer than k keys


@needs_interpreter
def test_ties_prefer_recent_keys_and_strided_inputs():
    """w = 0: every visible score is 0, so each query keeps its k most recent visible keys;
    q and k are non-contiguous views."""
    B, L, Hi, Di, topk = 1, 30, 2, 8, 5
    doc = torch.tensor([[0] * 12 + [1] * 18])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, L, Di, Hi, generator=g).transpose(2, 3)
    k = torch.randn(B, L, 2 * Di, generator=g)[..., ::2]
    w = torch.zeros(B, L, Hi)
    assert not q.is_contiguous() and not k.is_contiguous()
    idx = _check(q, k, w, doc, topk, 7, 16)
    assert set(idx[0, 25].tolist()) == set(range(21, 26))
    assert set(idx[0, 13].tolist()) == {12, 13, -1}


@needs_interpreter
def test_no_tile_bigger_than_a_chunk(monkeypatch):
    """Every score tile has at most `chunk` query rows and spans only the keys from the
    document start of the chunk's first query to its last query: never [L, L]."""
    B, L, Hi, Di, topk, chunk = 1, 48, 2, 8, 6, 12
    doc = _docs(B, L, (20,))
    q, k, w = _inputs(B, L, Hi, Di, True, seed=5)
    shapes = []
    real = tb._score_tile

    def spy(*args):
        out = real(*args)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(tb, "_score_tile", spy)
    tb.lightning_indexer(q, k, w, doc, topk, chunk_size=chunk)
    assert shapes == [(12, 12), (12, 24), (12, 16), (12, 28)]


def test_registered_for_cuda_only():
    b = ops.registry.backends("lightning_indexer")["triton"]
    assert b.device_types == ("cuda",) and b.available()
    assert ops.registry.select("lightning_indexer", "cpu").name != "triton"


def test_in_subprocess():
    if _INTERPRETED:
        pytest.skip("the interpreter tests ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
