"""Chunked dense warm-up indexer KL (ops/indexer_kl/chunked.py) vs the full-matrix reference:
same value and same gradients w.r.t. the indexer's q, k, w (odd lengths, several documents,
chunks of 1 row, crossing document starts, bigger than L), the model's dense warm-up loss
unchanged, and memory: no intermediate or saved tensor grows like L^2.

Tolerances: rtol = 1e-4 on the value, rtol = atol = 1e-4 on gradients (float32, different
summation order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.transformer import Transformer
from wanka.ops.indexer_kl import chunked, reference

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("WANKA_OPS_BACKEND", raising=False)


def _docs(B, L, cuts):
    d = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for c in cuts:
            d[b, min(L - 1, c + 2 * b) :] += 1
    return d


def _inputs(B, L, H, D, Hi, Di, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, H, D, generator=g)
    k = torch.randn(B, L, D, generator=g)
    qi = torch.randn(B, L, Hi, Di, generator=g)
    ki = torch.randn(B, L, Di, generator=g)
    wi = torch.randn(B, L, Hi, generator=g)
    return q, k, qi, ki, wi


CASES = [  # B, L, H, D, Hi, Di, cuts, chunk
    (2, 37, 4, 8, 3, 8, (), 5),  # odd L, one document
    (2, 45, 2, 16, 4, 8, (9, 30), 7),  # 3 documents, chunks crossing document starts
    (1, 23, 3, 8, 2, 4, (4, 5, 17), 1),  # a 1-token document, 1-row chunks
    (1, 16, 2, 8, 2, 8, (6,), 64),  # chunk > L: one block
    (2, 40, 2, 8, 2, 8, (13,), None),  # default chunk size
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{c[1]}-docs{len(c[6]) + 1}-C{c[7]}")
def test_matches_full_matrix_reference(case):
    B, L, H, D, Hi, Di, cuts, chunk = case
    q, k, qi, ki, wi = _inputs(B, L, H, D, Hi, Di, seed=L)
    doc = _docs(B, L, cuts)
    scale = D**-0.5
    ref_leaves = [x.clone().requires_grad_(True) for x in (qi, ki, wi)]
    kl_r = reference.indexer_kl(q, k, *ref_leaves, doc, scale)
    leaves = [x.clone().requires_grad_(True) for x in (qi, ki, wi)]
    kl_c = chunked.indexer_kl(q, k, *leaves, doc, scale, chunk_size=chunk)
    assert kl_c.dtype == torch.float32 and kl_c.shape == ()
    assert float(kl_r.detach()) > 0
    torch.testing.assert_close(kl_c, kl_r, rtol=1e-4, atol=1e-5)
    g_r = torch.autograd.grad(kl_r * 0.7, ref_leaves)
    g_c = torch.autograd.grad(kl_c * 0.7, leaves)
    for name, a, b in zip(("dq", "dk", "dw"), g_c, g_r, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_grad_only_for_requested_inputs_and_none_for_target():
    B, L = 1, 19
    q, k, qi, ki, wi = _inputs(B, L, 2, 8, 2, 8, seed=3)
    q.requires_grad_(True)  # the target side never gets a gradient (as in the reference)
    qi.requires_grad_(True)
    kl = chunked.indexer_kl(q, k, qi, ki, wi, _docs(B, L, (7,)), 0.3, chunk_size=4)
    kl.backward()
    assert qi.grad is not None and torch.isfinite(qi.grad).all() and q.grad is None


def test_registry_picks_chunked_everywhere():
    for dev in ("cpu", "cuda", "npu"):
        assert ops.select("indexer_kl", dev).name == "chunked"


def test_tiles_bounded_by_chunk(monkeypatch):
    """Every intermediate is one block of at most `chunk` queries against the keys from the
    block's first document start to its last query (so O(chunk x L), never [L, L])."""
    B, L, H, D, Hi, Di, chunk = 1, 48, 2, 8, 3, 8, 12
    q, k, qi, ki, wi = _inputs(B, L, H, D, Hi, Di)
    doc = _docs(B, L, (20,))
    seen = []
    real_t, real_s = chunked._target, chunked._scores

    def spy_t(q_c, k_s, vis, scale):
        out = real_t(q_c, k_s, vis, scale)
        seen.append(("target", tuple(out.shape), q_c.shape[1]))
        return out

    def spy_s(qi_c, ki_s, wi_c, vis):
        r, sc = real_s(qi_c, ki_s, wi_c, vis)
        seen.append(("scores", tuple(sc.shape), r.shape[1]))
        return r, sc

    monkeypatch.setattr(chunked, "_target", spy_t)
    monkeypatch.setattr(chunked, "_scores", spy_s)
    qi.requires_grad_(True)
    chunked.indexer_kl(q, k, qi, ki, wi, doc, D**-0.5, chunk_size=chunk).backward()
    spans = [12, 24, 16, 28]  # block end - document start of its first query (doc 1 at 20)
    expect = [(kind, (12, s), h) for s in spans for kind, h in (("target", H), ("scores", Hi))]
    assert seen == expect  # one pass: the gradients are computed with the value


def _saved_numels(fn) -> list[int]:
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_saved_tensors_are_linear_in_length():
    """What autograd keeps for backward: the reference keeps [B, L, L] (and [B, L, Hi, L])
    tensors, the chunked op only O(L) ones (its gradients, input-sized), whatever L."""
    H, D, Hi, Di = 2, 8, 2, 8
    for L in (64, 128):
        args = [*_inputs(1, L, H, D, Hi, Di), torch.zeros(1, L, dtype=torch.long), 0.3]
        args[2].requires_grad_(True)  # qi
        biggest_input = max(x.numel() for x in args[:5])
        ref = _saved_numels(lambda a=args: reference.indexer_kl(*a))
        chk = _saved_numels(lambda a=args: chunked.indexer_kl(*a, chunk_size=8))
        assert max(ref) >= L * L
        assert max(chk) <= biggest_input


def test_default_chunk_bounds_the_largest_intermediate():
    for L, H, Hi in ((1024, 16, 4), (8192, 16, 64), (32768, 16, 4)):
        C = chunked._rows(L, H, Hi, None)
        assert C >= 1 and C * max(H, Hi) * L <= chunked.CHUNK_ELEMS


CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, head_dim=16, n_index_heads=2, index_head_dim=8,
                  index_topk=8, n_experts=4, n_active_experts=2, expert_hidden=32, dense_hidden=64,
                  max_seq_len=64)  # fmt: skip


def test_model_dense_warmup_loss_unchanged(monkeypatch):
    """The model's dense warm-up KL (and its indexer gradients) with the chunked op equals the
    one computed by the full-matrix reference."""

    def run():
        torch.manual_seed(0)
        with torch.device("meta"):
            m = Transformer(dataclasses.replace(CFG))
        m.to_empty(device="cpu")
        m.init_weights(0)
        L = 24
        tokens = torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(1))
        doc = torch.zeros(2, L, dtype=torch.int32)
        doc[:, 10:] = 1
        pos = torch.cat([torch.arange(10), torch.arange(L - 10)])[None].expand(2, L)
        parts = m(tokens, pos, doc, torch.full_like(tokens, -100), phase="dense_warmup")
        parts.kl_sum.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if "indexer" in n}
        return parts.kl_sum.detach(), grads

    kl_c, g_c = run()
    monkeypatch.setenv("WANKA_OPS_BACKEND", "indexer_kl=reference")
    kl_r, g_r = run()
    assert float(kl_r.detach()) > 0
    torch.testing.assert_close(kl_c, kl_r, rtol=1e-4, atol=1e-5)
    assert g_c.keys() == g_r.keys() and g_c
    for n in g_c:
        torch.testing.assert_close(g_c[n], g_r[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
