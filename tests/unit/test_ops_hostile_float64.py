"""float64 is the dtype to check gradients in (gradcheck), so the references, the definition
of correct, must not round it: their softmax used `.float()`, which lowers float64 to float32
(1e-7 errors, gradcheck fails). The CPU sparse attention kept its saved log-sum-exp in float32
whatever the input, so its float64 gradients were off by ~1e-5 from exact."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from wanka.ops.dense_attention import reference as dense_ref
from wanka.ops.extra_key_attention import reference as extra_ref
from wanka.ops.index_patterns import packed_doc_ids, random_indices
from wanka.ops.sparse_attention import cpu as sparse_cpu
from wanka.ops.sparse_attention import reference as sparse_ref

B, L, H, D, K, E = 1, 6, 2, 3, 3, 2


def _inputs(*shapes, seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*s, generator=g, dtype=torch.float64) * std).requires_grad_() for s in shapes
    ]


IDX = random_indices(B, L, K, seed=3)
DOC = torch.tensor([[0, 0, 0, 1, 1, 1]])


@pytest.mark.parametrize(
    "name, fn, shapes",
    [
        ("sparse_attention", lambda q, k, v: sparse_ref.sparse_attention(q, k, v, IDX, 0.5),
         [(B, L, H, D), (B, L, D), (B, L, D)]),
        ("dense_attention", lambda q, k, v: dense_ref.dense_attention(q, k, v, DOC, 0.5),
         [(B, L, H, D), (B, L, D), (B, L, D)]),
        ("extra_key_attention", lambda q, k, v, ek, ev: extra_ref.extra_key_attention(
            q, k, v, DOC, None, ek, ev, 0.5),
         [(B, L, H, D), (B, L, D), (B, L, D), (B, L, E, D), (B, L, E, D)]),
        ("extra_key_attention selected", lambda q, k, v, ek, ev: extra_ref.extra_key_attention(
            q, k, v, DOC, IDX, ek, ev, 0.5),
         [(B, L, H, D), (B, L, D), (B, L, D), (B, L, E, D), (B, L, E, D)]),
    ],
)  # fmt: skip
def test_references_pass_gradcheck_in_float64(name, fn, shapes):
    assert gradcheck(fn, _inputs(*shapes), eps=1e-6, atol=1e-8, rtol=1e-6), name


@pytest.mark.parametrize("strategy", ["auto", "gather", "union"])
def test_cpu_sparse_attention_float64_gradients_are_exact(strategy):
    b, n, h, d, k = 2, 23, 3, 5, 6
    q, kk, v, go = _inputs((b, n, h, d), (b, n, d), (b, n, d), (b, n, h, d), std=3.0)
    idx = random_indices(b, n, k, packed_doc_ids(b, n, 3), seed=1)
    got = sparse_cpu.sparse_attention(q, kk, v, idx, 0.5, strategy=strategy, chunk=7)
    want = sparse_ref.sparse_attention(q, kk, v, idx, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, r in zip(torch.autograd.grad(got, (q, kk, v), go),
                    torch.autograd.grad(want, (q, kk, v), go), strict=True):  # fmt: skip
        torch.testing.assert_close(a, r, rtol=1e-11, atol=1e-11)


def test_cpu_sparse_attention_decode_path_keeps_float64():
    """No gradient and fewer selections than keys takes the gather-only decode path: it must
    give what the chunked path (taken when a gradient is needed) gives, to float64 precision."""
    q, k, v = _inputs((2, 1, 3, 4), (2, 40, 4), (2, 40, 4), std=3.0)
    idx = random_indices(2, 40, 3, seed=2)[:, -1:]
    with torch.no_grad():
        decode = sparse_cpu.sparse_attention(q, k, v, idx, 0.5)
    chunked = sparse_cpu.sparse_attention(q, k, v, idx, 0.5)
    assert chunked.requires_grad and not decode.requires_grad  # the two paths
    torch.testing.assert_close(decode, chunked.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(decode, sparse_ref.sparse_attention(q, k, v, idx, 0.5).detach(),
                               rtol=1e-12, atol=1e-12)  # fmt: skip
