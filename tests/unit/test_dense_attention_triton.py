"""Triton dense-attention backend vs the reference, run on CPU tensors through the Triton
interpreter (TRITON_INTERPRET=1, set before triton is imported): outputs and q/k/v
gradients over 1 and 3 documents per row, one and several query/key tiles per row (so key
tiles before a document start are skipped and partial ones masked), a ragged last tile,
non-contiguous inputs, poisoned outputs.

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
from wanka.ops.dense_attention import reference  # noqa: E402
from wanka.ops.dense_attention import triton as tb  # noqa: E402

# Triton binds interpreter mode when it is imported (its own tl helpers are jit functions
# too). If another test module imported wanka.ops (hence triton) first, these tests cannot
# run in this process: test_in_subprocess reruns this file alone in a fresh interpreter.
_INTERPRETED = type(tb._fwd_kernel).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not _INTERPRETED, reason="triton imported before TRITON_INTERPRET; see test_in_subprocess"
)

TOL = {"rtol": 1e-3, "atol": 1e-3}


def _doc_ids(B, L, n_docs):
    """[B, L] non-decreasing; with 3 documents the boundaries differ between rows."""
    d = torch.zeros(B, L, dtype=torch.long)
    if n_docs == 3:
        for b in range(B):
            a, c = L // 4 + 3 * b, (2 * L) // 3 - 2 * b
            d[b, a:] = 1
            d[b, c:] = 2
    return d


def _run(q, k, v, doc, scale, block=None):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = tb._DenseAttention.apply(q, k, v, doc, scale, block)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, (q, k, v), g)
    qr, kr, vr = (x.detach().requires_grad_(True) for x in (q, k, v))
    ref = reference.dense_attention(qr, kr, vr, doc, scale)
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


CASES = [  # L, H, D, documents, block
    (37, 2, 16, 1, None),  # one tile of 64 per row
    (37, 4, 32, 3, None),
    (64, 2, 32, 1, 16),  # four tiles per row: causal tile skipping
    (64, 4, 16, 3, 16),  # document-start skipping inside rows
    (37, 4, 16, 3, 16),  # ragged last tile
]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[0]}-H{c[1]}-D{c[2]}-docs{c[3]}-b{c[4]}")
def test_matches_reference(case):
    L, H, D, n_docs, block = case
    q, k, v = _inputs(2, L, H, D)
    _run(q, k, v, _doc_ids(2, L, n_docs), D**-0.5, block)


@needs_interpreter
def test_strided_inputs():
    """Non-contiguous q/k/v (k and v slices of one tensor)."""
    B, L, H, D = 2, 40, 2, 16
    q, _, _ = _inputs(B, L, H, D, seed=4)
    q = q.transpose(2, 3).contiguous().transpose(2, 3)  # strides differ from contiguous
    kv = torch.randn(B, L, 2 * D, generator=torch.Generator().manual_seed(5))
    k, v = kv[..., :D], kv[..., D:]
    assert not q.is_contiguous() and not k.is_contiguous()
    _run(q, k, v, _doc_ids(B, L, 3), 0.3, block=16)


def test_doc_bounds():
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    start, end = tb._doc_bounds(doc)
    assert start.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6]
    assert end.tolist() == [[2, 2, 5, 5, 5, 6], [6] * 6]


def test_registered_for_cuda():
    b = ops.registry.backends("dense_attention")["triton"]
    assert b.device_types == ("cuda",) and b.available()
    assert ops.registry.select("dense_attention", "cuda").name == "triton"
    assert ops.registry.select("dense_attention", "cpu").name != "triton"


def test_in_subprocess():
    if _INTERPRETED:
        pytest.skip("the interpreter tests ran in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
