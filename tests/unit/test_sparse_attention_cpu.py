"""CPU sparse-attention backend vs the reference: outputs and q/k/v gradients, both index
patterns, every strategy, -1 padding anywhere, documents, poisoned outputs; registry choice;
and that no row gather ever spans more than one chunk of queries.

Tolerances: rtol = atol = 1e-4 in float32 (both sides compute in float32, different
summation order); the float64 test is at 1e-5 because the reference's softmax runs in float32.
"""

import pytest
import torch

from wanka import ops
from wanka.ops.index_patterns import random_indices, realistic_indices
from wanka.ops.sparse_attention import cpu, reference

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _doc_ids(B, L, cuts):
    d = torch.zeros(B, L, dtype=torch.long)
    for c in cuts:
        d[:, c:] += 1
    return d


def _check_indices(idx, doc_ids=None):
    B, L, K = idx.shape
    t = torch.arange(L)[None, :, None]
    valid = idx >= 0
    assert (~valid | (idx <= t)).all(), "a key from the future"
    assert (idx == t).any(-1).all(), "a query misses itself"
    s = idx.sort(-1).values
    assert not ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(), "duplicates"
    if doc_ids is not None:
        key_doc = doc_ids.gather(1, idx.clamp(min=0).view(B, -1)).view(B, L, K)
        assert (~valid | (key_doc == doc_ids[:, :, None])).all(), "a key from another document"
    visible = (t + 1) if doc_ids is None else None
    if visible is not None:  # every row is full unless fewer than K keys are visible
        assert (valid.sum(-1) == visible[..., 0].clamp(max=K)).all()


def _shuffle_slots(idx, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.rand(idx.shape, generator=g).argsort(-1)
    return idx.gather(-1, perm)  # -1 padding ends up anywhere in the row


CASES = [  # B, L, K, H, D, pattern, doc cuts
    (2, 37, 24, 4, 8, "random", ()),
    (2, 130, 24, 3, 16, "random", (50, 51, 90)),  # documents (one of length 1)
    (1, 130, 24, 2, 8, "realistic", ()),
    (2, 130, 200, 4, 8, "random", ()),  # K > L: every row padded
    (2, 300, 64, 4, 32, "realistic", ()),
    (1, 300, 40, 2, 16, "random", (120,)),
]


@pytest.mark.parametrize("strategy", ["auto", "gather", "union"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}-L{c[1]}-K{c[2]}")
def test_matches_reference(monkeypatch, case, strategy):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")
    B, L, K, H, D, pattern, cuts = case
    gen = torch.Generator().manual_seed(L * K + H)
    doc_ids = _doc_ids(B, L, cuts) if cuts else None
    if pattern == "random":
        idx = random_indices(B, L, K, doc_ids=doc_ids, seed=L + K)
    else:
        idx = realistic_indices(B, L, K, window=K // 2, n_heavy=K // 8, seed=L + K)
    _check_indices(idx, doc_ids)
    idx = _shuffle_slots(idx, seed=K)
    q = torch.randn(B, L, H, D, generator=gen, requires_grad=True)
    k = torch.randn(B, L, D, generator=gen, requires_grad=True)
    v = torch.randn(B, L, D, generator=gen, requires_grad=True)
    dout = torch.randn(B, L, H, D, generator=gen)
    scale = D**-0.5

    ref = reference.sparse_attention(q, k, v, idx, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for chunk in (None, 7) if L < 200 else (None,):
        out = cpu.sparse_attention(q, k, v, idx, scale, strategy=strategy, chunk=chunk)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.testing.assert_close(out, ref, **TOL)
        for name, g, r in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(g, r, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


def test_float64_and_partial_grads(monkeypatch):
    monkeypatch.setenv("WANKA_OPS_POISON", "1")
    B, L, K, H, D = 1, 61, 20, 2, 8
    idx = realistic_indices(B, L, K, window=8, n_heavy=4, seed=3)
    q = torch.randn(B, L, H, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, L, D, dtype=torch.float64)  # no grad wanted for k
    v = torch.randn(B, L, D, dtype=torch.float64, requires_grad=True)
    out = cpu.sparse_attention(q, k, v, idx, 0.3, chunk=16)
    ref = reference.sparse_attention(q, k, v, idx, 0.3)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    gq, gv = torch.autograd.grad(out.square().sum(), (q, v))
    rq, rv = torch.autograd.grad(ref.square().sum(), (q, v))
    torch.testing.assert_close(gq, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gv, rv, rtol=1e-5, atol=1e-5)


def test_noncontiguous_and_bfloat16():
    B, L, K, H, D = 2, 40, 12, 4, 8
    idx = random_indices(B, L, K, seed=5)
    q = torch.randn(B, H, L, D).transpose(1, 2)  # [B, L, H, D], not contiguous
    k, v = torch.randn(B, L, D), torch.randn(B, L, D)
    torch.testing.assert_close(
        cpu.sparse_attention(q, k, v, idx, 0.5),
        reference.sparse_attention(q, k, v, idx, 0.5),
        **TOL,
    )
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = cpu.sparse_attention(qb, kb, vb, idx, 0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.sparse_attention(q, k, v, idx, 0.5),
                               rtol=3e-2, atol=3e-2)  # fmt: skip


def test_registry_picks_cpu_backend_and_env_forces_reference(monkeypatch):
    monkeypatch.delenv("WANKA_OPS_BACKEND", raising=False)
    assert ops.select("sparse_attention", "cpu").name == "cpu"
    monkeypatch.setenv("WANKA_OPS_BACKEND", "sparse_attention=reference")
    assert ops.select("sparse_attention", "cpu").name == "reference"


def test_bad_strategy_raises():
    q, k, v = torch.randn(1, 4, 1, 2), torch.randn(1, 4, 2), torch.randn(1, 4, 2)
    with pytest.raises(ValueError):
        cpu.sparse_attention(q, k, v, random_indices(1, 4, 2), 1.0, strategy="nope")


@pytest.mark.parametrize("strategy", ["auto", "gather", "union"])
@pytest.mark.parametrize("pattern", ["random", "realistic"])
def test_gathers_stay_within_one_chunk(monkeypatch, strategy, pattern):
    """Every K/V row gather (forward and backward) reads at most chunk * K rows, never the
    [L, K] selection of the whole sequence; and the module has no other gather route."""
    B, L, K, H, D, chunk = 1, 257, 24, 2, 8, 16
    idx = (random_indices if pattern == "random" else realistic_indices)(B, L, K, seed=1)
    seen = []
    real_rows = cpu._rows

    def rows(x, i):
        out = real_rows(x, i)
        seen.append(i.numel())
        assert i.numel() <= chunk * K, f"gathered {i.numel()} rows, chunk allows {chunk * K}"
        assert out.numel() <= chunk * K * D
        return out

    monkeypatch.setattr(cpu, "_rows", rows)
    assert not hasattr(cpu, "gather_rows")  # the reference's whole-sequence gather
    q = torch.randn(B, L, H, D, requires_grad=True)
    k = torch.randn(B, L, D, requires_grad=True)
    v = torch.randn(B, L, D, requires_grad=True)
    out = cpu.sparse_attention(q, k, v, idx, 0.5, strategy=strategy, chunk=chunk)
    # what backward keeps: q, k, v, indices, out and the [B, L, H] log-sum-exp only
    saved = out.grad_fn.saved_tensors
    assert sum(t.numel() for t in saved) == 2 * q.numel() + 2 * k.numel() + idx.numel() + B * L * H
    out.sum().backward()
    assert seen and max(seen) <= chunk * K
