"""`extra_key_attention`: one softmax over a query's visible (or selected) keys and its own
extra keys, checked against attention over an explicitly built key list per query."""

from __future__ import annotations

import pytest
import torch

from wanka import ops


def _brute(q, k, v, doc_ids, indices, extra_k, extra_v, scale):
    B, L, H, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for t in range(L):
            if indices is None:
                keys = [s for s in range(t + 1) if doc_ids[b, s] == doc_ids[b, t]]
            else:
                keys = [int(s) for s in indices[b, t] if s >= 0]
            ks = torch.cat([k[b, keys], extra_k[b, t]], 0)  # [n + E, D]
            vs = torch.cat([v[b, keys], extra_v[b, t]], 0)
            p = torch.softmax(q[b, t] @ ks.T * scale, dim=-1)  # [H, n + E]
            out[b, t] = p @ vs
    return out


def _inputs(E: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, L, H, D = 2, 11, 3, 8
    q, k, v = (torch.randn(B, L, H, D, generator=g), torch.randn(B, L, D, generator=g),
               torch.randn(B, L, D, generator=g))  # fmt: skip
    extra_k, extra_v = torch.randn(B, L, E, D, generator=g), torch.randn(B, L, E, D, generator=g)
    doc_ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 11])
    return q, k, v, doc_ids, extra_k, extra_v


def _selection(doc_ids: torch.Tensor, K: int, seed: int) -> torch.Tensor:
    """Up to K visible keys per query in random order, -1 padding anywhere in the row."""
    g = torch.Generator().manual_seed(seed)
    B, L = doc_ids.shape
    idx = torch.full((B, L, K), -1, dtype=torch.long)
    for b in range(B):
        for t in range(L):
            vis = [s for s in range(t + 1) if doc_ids[b, s] == doc_ids[b, t]]
            pick = [vis[i] for i in torch.randperm(len(vis), generator=g)[:K].tolist()]
            slots = torch.randperm(K, generator=g)[: len(pick)]
            idx[b, t, slots] = torch.tensor(pick)
    return idx


@pytest.mark.parametrize("E", [1, 3])
@pytest.mark.parametrize("sparse", [False, True])
def test_matches_attention_over_each_querys_key_list(E, sparse):
    q, k, v, doc_ids, extra_k, extra_v = _inputs(E)
    indices = _selection(doc_ids, 4, seed=E) if sparse else None
    leaves = [x.requires_grad_() for x in (q, k, v, extra_k, extra_v)]
    got = ops.call("extra_key_attention", q, k, v, doc_ids, indices, extra_k, extra_v, 0.35)
    want = _brute(q, k, v, doc_ids, indices, extra_k, extra_v, 0.35)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(got)
    g_got = torch.autograd.grad((got * w).sum(), leaves)
    g_want = torch.autograd.grad((want * w).sum(), leaves)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_query_with_no_selected_key_reads_only_its_extra_keys():
    """All slots empty (K - E = 0 left of the selection): the extra keys alone, no NaN."""
    q, k, v, doc_ids, extra_k, extra_v = _inputs(2)
    empty = torch.full((2, 11, 3), -1, dtype=torch.long)
    got = ops.call("extra_key_attention", q, k, v, doc_ids, empty, extra_k, extra_v, 0.5)
    p = torch.softmax(torch.einsum("blhd,bled->blhe", q, extra_k) * 0.5, -1)
    torch.testing.assert_close(got, torch.einsum("blhe,bled->blhd", p, extra_v))
    none = ops.call("extra_key_attention", q, k, v, doc_ids, empty[..., :0], extra_k, extra_v, 0.5)
    torch.testing.assert_close(none, got)


def test_mismatched_shapes_are_refused():
    q, k, v, doc_ids, extra_k, extra_v = _inputs(1)
    with pytest.raises(ValueError, match="same positions"):
        ops.call("extra_key_attention", q, k, v, doc_ids, None, extra_k[:, 1:], extra_v, 0.5)
