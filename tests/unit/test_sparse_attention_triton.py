"""Triton sparse-attention backend vs the reference, run on CPU tensors through the Triton
interpreter (TRITON_INTERPRET=1, set before triton is imported): outputs and q/k/v
gradients with random indices over 2 documents, -1 padding anywhere in a row (including a
whole tile of it), several slot tiles per row, non-contiguous inputs, poisoned outputs;
duplicate indices (counted once per slot, as the reference does) and inf/NaN planted in one
document (the other document's outputs and gradients stay finite and unchanged).

Tolerances: rtol = atol = 1e-3 in float32 (both sides float32, different summation order).
"""

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from wanka import ops  # noqa: E402
from wanka.ops.index_patterns import random_indices  # noqa: E402
from wanka.ops.sparse_attention import reference  # noqa: E402
from wanka.ops.sparse_attention import triton as tb  # noqa: E402

# Triton binds interpreter mode when it is imported (its own tl helpers are jit functions
# too). If another test module imported wanka.ops (hence triton) first, these tests cannot
# run in this process: test_in_subprocess reruns this file alone in a fresh interpreter.
_INTERPRETED = type(tb._fwd_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not _INTERPRETED, reason="triton imported before TRITON_INTERPRET; see test_in_subprocess"
)

TOL = {"rtol": 1e-3, "atol": 1e-3}


def _doc_ids(B, L):
    d = torch.zeros(B, L, dtype=torch.long)
    d[:, L // 2 :] = 1
    return d


def _shuffle_slots(idx, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.rand(idx.shape, generator=g).argsort(-1)
    return idx.gather(-1, perm)


def _run(q, k, v, idx, scale, block_k=None):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = tb._SparseAttention.apply(q, k, v, idx, scale, block_k)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, (q, k, v), g)
    qr, kr, vr = (x.detach().requires_grad_(True) for x in (q, k, v))
    ref = reference.sparse_attention(qr, kr, vr, idx, scale)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), g)
    torch.testing.assert_close(out, ref, **TOL)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(a).all(), f"d{name} has non-finite values"
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


def _inputs(B, L, H, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, L, H, D, generator=g),
        torch.randn(B, L, D, generator=g),
        torch.randn(B, L, D, generator=g),
    )


CASES = [  # B, L, H, D, K, block_k
    (2, 37, 2, 16, 8, None),
    (2, 64, 4, 32, 24, None),  # K > visible keys early in each document: -1 slots
    (2, 37, 4, 16, 24, 16),  # two slot tiles per row
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[1]}-H{c[2]}-D{c[3]}-K{c[4]}")
def test_matches_reference(case):
    B, L, H, D, K, block_k = case
    idx = _shuffle_slots(random_indices(B, L, K, doc_ids=_doc_ids(B, L), seed=1), seed=2)
    assert (idx < 0).any()
    q, k, v = _inputs(B, L, H, D)
    _run(q, k, v, idx, D**-0.5, block_k)


@needs_interpreter
def test_empty_tile_and_strided_inputs():
    """A whole leading tile of -1 slots, and non-contiguous q/k/v."""
    B, L, H, D, K = 1, 24, 2, 16, 8
    idx = random_indices(B, L, K, doc_ids=_doc_ids(B, L), seed=3)
    idx = torch.cat([torch.full((B, L, 16), -1, dtype=torch.long), idx], dim=-1)
    q, k, v = _inputs(B, L, H, D, seed=4)
    q = q.transpose(2, 3).contiguous().transpose(2, 3)  # strides differ from contiguous
    kv = torch.randn(B, L, 2 * D, generator=torch.Generator().manual_seed(5))
    k, v = kv[..., :D], kv[..., D:]
    assert not q.is_contiguous() and not k.is_contiguous()
    _run(q, k, v, idx, 0.3, block_k=16)


@needs_interpreter
def test_duplicate_indices_count_per_slot():
    """A key in several slots of one query counts once per slot, in one tile and across
    tiles (block_k 16 with K = 24: slots 0 and 20 hold the same key)."""
    B, L, H, D, K = 1, 40, 2, 16, 24
    idx = random_indices(B, L, K, doc_ids=_doc_ids(B, L), seed=6)
    n = (idx >= 0).sum(-1, keepdim=True)  # valid slots come first
    first = idx[..., :1]
    idx.scatter_(-1, n.clamp(max=K - 1), torch.where(n < K, first, idx[..., -1:]))
    idx[..., 20] = torch.where(idx[..., 20] >= 0, first[..., 0], -1)
    idx[..., 1] = torch.where(n[..., 0] >= 2, first[..., 0], idx[..., 1])
    q, k, v = _inputs(B, L, H, D, seed=8)
    _run(q, k, v, idx, 0.3, block_k=16)


@needs_interpreter
def test_nonfinite_values_stay_in_their_document():
    """inf/NaN in document 0 (row 0 of K and V, which the reference's empty slots read
    before the fix, and one query): document 1's outputs and gradients match the clean
    inputs' reference."""
    B, L, H, D, K = 1, 32, 2, 16, 12
    idx = _shuffle_slots(random_indices(B, L, K, doc_ids=_doc_ids(B, L), seed=9), seed=10)
    assert (idx[:, L // 2 :] < 0).any()
    q, k, v = _inputs(B, L, H, D, seed=11)
    bq, bk, bv = q.clone(), k.clone(), v.clone()
    bk[:, 0] = float("inf")
    bv[:, 0] = float("nan")
    bq[:, 3, 1] = float("inf")
    g = torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(12))

    def grads(fn, q, k, v):
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = fn(q, k, v)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), g))

    got = grads(lambda q, k, v: tb._SparseAttention.apply(q, k, v, idx, 0.4, None), bq, bk, bv)
    want = grads(lambda q, k, v: reference.sparse_attention(q, k, v, idx, 0.4), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        a, b = a[:, L // 2 :], b[:, L // 2 :]
        assert torch.isfinite(a).all(), f"{name}: a non-finite value left document 0"
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_registered_for_cuda():
    b = ops.registry.backends("sparse_attention")["triton"]
    assert b.device_types == ("cuda",) and b.available()
    assert ops.registry.select("sparse_attention", "cpu").name != "triton"


def test_in_subprocess():
    if _INTERPRETED:
        pytest.skip("the interpreter tests ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
