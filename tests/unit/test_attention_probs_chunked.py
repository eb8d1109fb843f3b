"""The indexer's KL target in blocks of queries (ops/dense_attention/probs_chunked.py) vs the
reference: same [B, L, K] values over selected keys (odd lengths, k not a power of two, k above
the visible keys so slots are empty, several documents, 1-row blocks, a block bigger than L)
and the same [B, L, L] over visible keys; outputs poisoned so an unwritten element fails; the
registry picks it everywhere; and no block gathers more than its own rows.

Tolerance: rtol = atol = 1e-5 (float32, different summation order).
"""

from __future__ import annotations

import pytest
import torch

from wanka import ops
from wanka.ops import registry
from wanka.ops.dense_attention import probs_chunked, reference
from wanka.ops.index_patterns import random_indices, realistic_indices

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    monkeypatch.delenv("WANKA_OPS_BACKEND", raising=False)
    monkeypatch.setenv("WANKA_OPS_POISON", "1")


def _docs(B, L, cuts):
    d = torch.zeros(B, L, dtype=torch.long)
    for c in cuts:
        d[:, c:] += 1
    return d


CASES = [  # B, L, H, D, K, cuts, chunk, pattern
    (2, 37, 4, 8, 5, (), 4, "random"),  # odd L, K not a power of 2, K > keys of early queries
    (1, 45, 3, 16, 12, (9, 30), 7, "random"),  # 3 documents, blocks crossing document starts
    (1, 23, 2, 8, 6, (4, 5, 17), 1, "random"),  # a 1-token document, 1-row blocks
    (2, 64, 2, 8, 16, (), 100, "realistic"),  # block > L
    (1, 50, 4, 8, 7, (20,), None, "random"),  # default block size
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"L{c[1]}-K{c[4]}-docs{len(c[5]) + 1}-C{c[6]}"
)
def test_matches_reference(case):
    B, L, H, D, K, cuts, chunk, pattern = case
    g = torch.Generator().manual_seed(L)
    q, k = torch.randn(B, L, H, D, generator=g), torch.randn(B, L, D, generator=g)
    doc = _docs(B, L, cuts)
    if pattern == "random":
        idx = random_indices(B, L, K, doc_ids=doc, seed=L)
    else:
        idx = realistic_indices(B, L, K, seed=L)
    assert (idx < 0).any() or pattern == "realistic"  # some slots empty: K > visible keys
    got = probs_chunked.attention_probs(q, k, doc, 0.3, indices=idx, chunk_size=chunk)
    want = reference.attention_probs(q, k, doc, 0.3, indices=idx)
    assert got.shape == (B, L, K) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL)
    dense = probs_chunked.attention_probs(q, k, doc, 0.3, chunk_size=chunk)
    torch.testing.assert_close(dense, reference.attention_probs(q, k, doc, 0.3), **TOL)


def test_registry_picks_it_and_blocks_gather_only_their_rows(monkeypatch):
    for device_type in ("cpu", "cuda", "npu", "xpu"):
        assert registry.select("attention_probs", device_type).name == "chunked"
    B, L, H, D, K, C = 1, 40, 2, 8, 6, 8
    q, k = torch.randn(B, L, H, D), torch.randn(B, L, D)
    idx = random_indices(B, L, K, seed=3)
    gathered = []
    real = torch.Tensor.index_select

    def spy(self, dim, index):
        gathered.append(index.numel())
        return real(self, dim, index)

    monkeypatch.setattr(torch.Tensor, "index_select", spy)
    out = probs_chunked.attention_probs(q, k, torch.zeros(B, L, dtype=torch.long), 0.5,
                                        indices=idx, chunk_size=C)  # fmt: skip
    assert gathered and max(gathered) <= C * K and sum(gathered) == L * K
    assert out.sum(-1).allclose(torch.ones(B, L))
    via_registry = ops.call("attention_probs", q, k, torch.zeros(B, L, dtype=torch.long), 0.5,
                            indices=idx)  # fmt: skip
    torch.testing.assert_close(via_registry, out, **TOL)


def test_rejects_documents_out_of_order():
    q, k = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 4)
    with pytest.raises(ValueError, match="non-decreasing"):
        probs_chunked.attention_probs(q, k, torch.tensor([[0, 0, 1, 1, 0, 0]]), 0.5)
