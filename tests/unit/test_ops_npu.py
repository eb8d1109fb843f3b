"""NPU backends (ops/*/npu.py) on CPU, against a stand-in `torch_npu` injected into
sys.modules. The stand-in's fused functions check the documented call contract of the real
ones (layouts, shapes, dtypes, contiguity, argument values) and compute the result with
wanka's reference in the op's own layout, so these tests check that the layout conversion
round-trips (wanka layout -> BSND/TND -> wanka layout, forward and gradients) and that the
result matches the reference; plus the fallback to the reference (with one log line per
reason) outside the fused ops' limits, and registry selection.

Tolerances: bfloat16 inputs (what the fused ops take): values rtol = atol = 2e-2, gradients
rtol = atol = 5e-2 (the stand-in computes in float32, the reference partly in bfloat16).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from wanka import ops
from wanka.ops import npu_common
from wanka.ops.lightning_indexer import npu as li_npu
from wanka.ops.lightning_indexer import reference as li_ref
from wanka.ops.sparse_attention import npu as sa_npu
from wanka.ops.sparse_attention import reference as sa_ref

BF16 = torch.bfloat16
VAL_TOL = {"rtol": 2e-2, "atol": 2e-2}
GRAD_TOL = {"rtol": 5e-2, "atol": 5e-2}


# --- the stand-in torch_npu -------------------------------------------------------------


def _check_cu(cu, T):
    assert cu.dtype == torch.int32 and cu.dim() == 1 and int(cu[-1]) == T
    assert bool((cu[1:] >= cu[:-1]).all()) and int(cu[0]) > 0
    return [0, *cu.tolist()]


def _fake_indexer(query, key, weights, *, actual_seq_lengths_query=None,
                  actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                  layout_key="BSND", sparse_count=2048, sparse_mode=3,
                  pre_tokens=2**63 - 1, next_tokens=2**63 - 1, return_value=False):  # fmt: skip
    """TND only (what wanka uses): per sequence, the reference's top-k; valid slots listed in
    ascending key order (an order other than wanka's), empty slots -1 with a junk score."""
    FAKE.calls.append("npu_lightning_indexer")
    T = query.shape[0]
    assert layout_query == layout_key == "TND" and block_table is None
    assert query.shape == (T, 64, 128) and key.shape == (T, 1, 128) and weights.shape == (T, 64)
    assert query.dtype in (torch.float16, BF16) and key.dtype == weights.dtype == query.dtype
    assert all(x.is_contiguous() for x in (query, key, weights))
    assert 1 <= sparse_count <= 2048 and sparse_mode == 3 and return_value
    assert torch.equal(actual_seq_lengths_query, actual_seq_lengths_key)
    bounds = _check_cu(actual_seq_lengths_query, T)
    idx = torch.full((T, 1, sparse_count), -1, dtype=torch.int32)
    val = torch.full((T, 1, sparse_count), 7.0, dtype=query.dtype)  # junk in empty slots
    for s, e in zip(bounds[:-1], bounds[1:]):
        doc = torch.zeros(1, e - s, dtype=torch.long)
        with torch.no_grad():
            i, v = li_ref.lightning_indexer(
                query[None, s:e], key[None, s:e, 0], weights[None, s:e], doc, sparse_count
            )
        i, v = i[0], v[0]
        order = torch.where(i >= 0, i, 1 << 30).argsort(-1)  # ascending key, empty last
        i, v = i.gather(-1, order), v.gather(-1, order)
        idx[s:e, 0] = torch.where(i >= 0, i, -1).to(torch.int32)
        val[s:e, 0] = torch.where(i >= 0, v, torch.full_like(v, 7.0))
    return idx, val


def _fake_indexer_grad(query, key, dy, sparse_indices, weights, actual_seq_lengths_query=None,
                       actual_seq_lengths_key=None, layout="BSND", sparse_mode=3,
                       pre_tokens=2**63 - 1, next_tokens=2**63 - 1):  # fmt: skip
    FAKE.calls.append("npu_lightning_indexer_grad")
    T = query.shape[0]
    assert layout == "TND" and sparse_mode == 3
    assert dy.shape == sparse_indices.shape == (T, 1, sparse_indices.shape[-1])
    assert dy.dtype == query.dtype and sparse_indices.dtype == torch.int32
    bounds = _check_cu(actual_seq_lengths_query, T)
    dq, dk, dw = torch.empty_like(query), torch.empty_like(key), torch.empty_like(weights)
    for s, e in zip(bounds[:-1], bounds[1:]):
        q, k, w = (x[s:e].float().requires_grad_(True) for x in (query, key[:, 0], weights))
        doc = torch.zeros(1, e - s, dtype=torch.long)
        with torch.enable_grad():  # called from inside a backward
            full = li_ref.indexer_scores(q[None], k[None], w[None], doc)[0]  # [n, n]
            rel = sparse_indices[s:e, 0].long()
            sel = full.gather(-1, rel.clamp(min=0))
            g = dy[s:e, 0].float()
            loss = torch.where(rel >= 0, sel * g, torch.zeros_like(g)).sum()
            a, b, c = torch.autograd.grad(loss, (q, k, w))
        dq[s:e], dk[s:e, 0], dw[s:e] = a.to(query.dtype), b.to(key.dtype), c.to(weights.dtype)
    return dq, dk, dw


def _check_sfa_inputs(query, key, value, sparse_indices, query_rope, key_rope, attention_mode,
                      sparse_block_size, sparse_mode, layouts):  # fmt: skip
    B, S1, N1, D = query.shape
    assert layouts == ("BSND", "BSND") and attention_mode == 2 and sparse_block_size == 1
    assert D == 512 and N1 in (1, 2, 4, 8, 16, 32, 64, 128) and sparse_mode in (0, 3)
    assert key.shape == (B, key.shape[1], 1, 512) and value.data_ptr() == key.data_ptr()
    assert query_rope.shape == (B, S1, N1, 64) and key_rope.shape == (B, key.shape[1], 1, 64)
    assert query.dtype in (torch.float16, BF16)
    assert all(x.dtype == query.dtype for x in (key, value, query_rope, key_rope))
    assert all(x.is_contiguous() for x in (query, key, query_rope, key_rope, sparse_indices))
    assert sparse_indices.dtype == torch.int32 and sparse_indices.shape[:3] == (B, S1, 1)
    invalid = sparse_indices[:, :, 0] < 0  # valid slots must come first
    assert not bool((invalid[..., :-1] & ~invalid[..., 1:]).any()), "valid slot after a -1"


def _sfa_leaves(query, key, value, query_rope, key_rope):
    qf = torch.cat([query, query_rope], -1).float().requires_grad_(True)
    kf = torch.cat([key[:, :, 0], key_rope[:, :, 0]], -1).float().requires_grad_(True)
    v = value[:, :, 0].float().requires_grad_(True)
    return qf, kf, v


def _fake_sfa(query, key, value, sparse_indices, scale_value, *, block_table=None,
              actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
              key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
              sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0,
              return_softmax_lse=False):  # fmt: skip
    FAKE.calls.append("npu_sparse_flash_attention")
    _check_sfa_inputs(query, key, value, sparse_indices, query_rope, key_rope, attention_mode,
                      sparse_block_size, sparse_mode, (layout_query, layout_kv))  # fmt: skip
    qf, kf, v = _sfa_leaves(query, key, value, query_rope, key_rope)
    idx = sparse_indices[:, :, 0].long()
    out = sa_ref.sparse_attention(qf, kf, v, idx, scale_value).to(query.dtype)
    if not return_softmax_lse:
        return out, torch.empty(0), torch.empty(0)
    B, S1, N1, _ = query.shape
    s = torch.einsum("blhd,blkd->blhk", qf, kf[torch.arange(B)[:, None, None], idx.clamp(min=0)])
    s = (s * scale_value).masked_fill((idx < 0)[:, :, None], float("-inf"))
    smax = s.max(-1).values
    ssum = (s - smax[..., None]).exp().sum(-1)
    lay = (B, 1, S1, N1)  # [B, N2, S1, N1 / N2]
    return out, smax[:, None].reshape(lay).detach(), ssum[:, None].reshape(lay).detach()


def _fake_sfa_grad(query, key, value, sparse_indices, d_out, out, softmax_max, softmax_sum,
                   scale_value, sparse_block_size, query_rope=None, key_rope=None,
                   actual_seq_qlen=None, actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                   pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0):  # fmt: skip
    FAKE.calls.append("npu_sparse_flash_attention_grad")
    _check_sfa_inputs(query, key, value, sparse_indices, query_rope, key_rope, attention_mode,
                      sparse_block_size, sparse_mode, (layout, layout))  # fmt: skip
    B, S1, N1, _ = query.shape
    assert softmax_max.shape == softmax_sum.shape == (B, 1, S1, N1)
    assert d_out.shape == out.shape == query.shape and d_out.is_contiguous()
    qf, kf, v = _sfa_leaves(query, key, value, query_rope, key_rope)
    with torch.enable_grad():  # called from inside a backward
        o = sa_ref.sparse_attention(qf, kf, v, sparse_indices[:, :, 0].long(), scale_value)
        dqf, dkf, dv = torch.autograd.grad(o, (qf, kf, v), d_out.float())
    dt = query.dtype
    return (dqf[..., :512].to(dt), dkf[:, :, None, :512].to(dt), dv[:, :, None].to(dt),
            dqf[..., 512:].to(dt), dkf[:, :, None, 512:].to(dt))  # fmt: skip


FAKE = types.ModuleType("torch_npu")
FAKE.calls = []
FAKE.npu_lightning_indexer = _fake_indexer
FAKE.npu_lightning_indexer_grad = _fake_indexer_grad
FAKE.npu_sparse_flash_attention = _fake_sfa
FAKE.npu_sparse_flash_attention_grad = _fake_sfa_grad


@pytest.fixture
def fake_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", FAKE)
    FAKE.calls.clear()
    return FAKE


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(npu_common, "_LOGGED", set())
    monkeypatch.delenv("WANKA_OPS_BACKEND", raising=False)
    monkeypatch.setenv("WANKA_OPS_POISON", "1")


def _docs(B, L, cuts):
    d = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        for c in cuts:
            d[b, c + 3 * b :] += 1
    return d


# --- lightning indexer ------------------------------------------------------------------


def _indexer_inputs(B, L, seed=0, positive=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, 64, 128, generator=g)
    k = torch.randn(B, L, 128, generator=g)
    w = torch.randn(B, L, 64, generator=g)
    if positive:  # scores > 0: no exact zero ties (the fused op's tie rule is undocumented)
        k, w = k.abs(), w.abs() + 0.1
        q[:, :, 0] = q[:, :, 0].abs()
    return q.to(BF16), k.to(BF16), w.to(BF16)


def _same_sets(idx_a, idx_b):
    K = idx_a.shape[-1]
    for ra, rb in zip(idx_a.reshape(-1, K), idx_b.reshape(-1, K), strict=True):
        assert set(ra[ra >= 0].tolist()) == set(rb[rb >= 0].tolist())


def test_indexer_forward_round_trips_tnd(fake_npu):
    B, L, topk = 2, 21, 7
    doc = _docs(B, L, (5, 12))  # 3 documents per row, boundaries differ between rows
    q, k, w = _indexer_inputs(B, L)
    with torch.no_grad():
        idx, val = li_npu.lightning_indexer(q, k, w, doc, topk)
        idx_r, val_r = li_ref.lightning_indexer(q, k, w, doc, topk)
    assert fake_npu.calls == ["npu_lightning_indexer"]
    assert idx.shape == val.shape == (B, L, topk) and idx.dtype == torch.int64
    assert torch.equal(idx < 0, torch.isinf(val)) and (idx < 0).any()
    torch.testing.assert_close(val.float(), val_r.float(), **VAL_TOL)  # re-sorted, descending
    _same_sets(idx, idx_r)


def test_indexer_backward_maps_gradients_back(fake_npu, monkeypatch):
    """With the grad op's documented top-k patched down to a small k, the gradients computed
    in the op's TND layout and slot order come back to wanka's tensors correctly."""
    B, L, topk = 2, 19, 6
    monkeypatch.setattr(li_npu, "GRAD_TOPK", topk)
    doc = _docs(B, L, (8,))  # documents of >= 6 tokens
    q, k, w = (x.requires_grad_(True) for x in _indexer_inputs(B, L, seed=1))
    idx, val = li_npu.lightning_indexer(q, k, w, doc, topk)
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, w)]
    idx_r, val_r = li_ref.lightning_indexer(*leaves, doc, topk)
    _same_sets(idx, idx_r)
    # bfloat16-representable upstream gradients: the op receives them in bfloat16
    r = torch.randn(B, L, topk, generator=torch.Generator().manual_seed(2)).to(BF16).float()
    pos = (idx[..., :, None] == idx_r[..., None, :]) & (idx >= 0)[..., None]
    r_npu = (pos.float() * r[..., None, :]).sum(-1)
    g = torch.autograd.grad((val.float().masked_fill(idx < 0, 0) * r_npu).sum(), (q, k, w))
    g_r = torch.autograd.grad((val_r.masked_fill(idx_r < 0, 0) * r).sum(), leaves)
    assert fake_npu.calls == ["npu_lightning_indexer", "npu_lightning_indexer_grad"]
    for name, a, b in zip("qkw", g, g_r, strict=True):
        assert a.dtype == BF16 and a.shape == b.shape
        torch.testing.assert_close(a.float(), b, **GRAD_TOL, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize(
    "change, reason",
    [
        ("float32", "dtype"),
        ("heads", "index heads"),
        ("topk", "top-k 3000"),
        ("grad_topk", "backward with top-k"),
        ("grad_short_doc", "document shorter"),
    ],
)
def test_indexer_falls_back_outside_limits(fake_npu, monkeypatch, caplog, change, reason):
    B, L, topk = 1, 16, 4
    doc = _docs(B, L, (6,))
    q, k, w = _indexer_inputs(B, L, seed=3)
    grad = False
    if change == "float32":
        q, k, w = q.float(), k.float(), w.float()
    elif change == "heads":
        q, w = q[:, :, :32], w[:, :, :32]
    elif change == "topk":
        topk = 3000
    elif change == "grad_topk":
        grad = True
    else:
        monkeypatch.setattr(li_npu, "GRAD_TOPK", topk)
        doc = _docs(B, L, (2,))  # a 2-token document < top-k
        grad = True
    q.requires_grad_(grad)
    with caplog.at_level(logging.WARNING, logger="wanka.ops.npu"):
        for _ in range(2):
            idx, val = li_npu.lightning_indexer(q, k, w, doc, topk)
    idx_r, val_r = li_ref.lightning_indexer(q, k, w, doc, topk)
    assert fake_npu.calls == []
    assert torch.equal(idx, idx_r) and torch.equal(val, val_r)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and reason in lines[0] and "lightning_indexer" in lines[0]


# --- sparse attention -------------------------------------------------------------------


def _sfa_inputs(B, L, H, K, seed=0):
    from wanka.ops.index_patterns import random_indices

    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, L, H, 512, generator=g) * 0.1).to(BF16)
    kv = torch.randn(B, L, 512, generator=g).to(BF16)
    idx = random_indices(B, L, K, doc_ids=_docs(B, L, (7,)), seed=seed)
    perm = torch.rand(idx.shape, generator=g).argsort(-1)  # -1 slots anywhere in a row
    return q, kv, idx.gather(-1, perm)


def test_sparse_attention_forward_round_trips_bsnd(fake_npu):
    B, L, H, K = 2, 17, 4, 6
    q, kv, idx = _sfa_inputs(B, L, H, K)
    assert (idx[..., 0] < 0).any()  # some rows start with an empty slot
    with torch.no_grad():
        out = sa_npu.sparse_attention(q, kv, kv, idx, 512**-0.5)
    ref = sa_ref.sparse_attention(q.float(), kv.float(), kv.float(), idx, 512**-0.5)
    assert fake_npu.calls == ["npu_sparse_flash_attention"]
    assert out.shape == (B, L, H, 512) and out.dtype == BF16
    torch.testing.assert_close(out.float(), ref, **VAL_TOL)


def test_sparse_attention_backward_maps_gradients_back(fake_npu, monkeypatch):
    B, L, H, K = 1, 15, 2, 5
    monkeypatch.setattr(sa_npu, "GRAD_TOPK", K)
    q, kv, idx = _sfa_inputs(B, L, H, K, seed=1)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out = sa_npu.sparse_attention(q, kv, kv, idx, 0.05)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(BF16).float()
    g = torch.autograd.grad(out, (q, kv), go.to(BF16))
    qr, kvr = (x.detach().float().requires_grad_(True) for x in (q, kv))
    ref = sa_ref.sparse_attention(qr, kvr, kvr, idx, 0.05)
    g_r = torch.autograd.grad(ref, (qr, kvr), go)
    assert fake_npu.calls == ["npu_sparse_flash_attention", "npu_sparse_flash_attention_grad"]
    for name, a, b in zip(("dq", "dkv (K and V sides)"), g, g_r, strict=True):
        torch.testing.assert_close(a.float(), b, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_sparse_attention_keeps_duplicate_slots(fake_npu):
    """Per-slot contract: the layout conversion keeps a repeated key in every slot (the
    fused op then counts each, like the reference)."""
    B, L, H, K = 1, 14, 2, 6
    q, kv, idx = _sfa_inputs(B, L, H, K, seed=4)
    first = idx.max(-1, keepdim=True).values  # the query itself
    idx = torch.where(idx < 0, first, idx)  # every empty slot repeats it
    idx[..., 0] = first[..., 0]
    npu_idx = sa_npu.to_npu_indices(idx)[:, :, 0].long()
    assert torch.equal(npu_idx.sort(-1).values, idx.sort(-1).values)
    with torch.no_grad():
        out = sa_npu.sparse_attention(q, kv, kv, idx, 0.05)
    ref = sa_ref.sparse_attention(q.float(), kv.float(), kv.float(), idx, 0.05)
    torch.testing.assert_close(out.float(), ref, **VAL_TOL)


@pytest.mark.parametrize("fused", [True, False])
def test_sparse_attention_nonfinite_stays_in_its_document(fake_npu, monkeypatch, fused):
    """inf in K/V row 0 (document 0) and NaN in a document-0 query: the later documents'
    outputs and gradients are finite and match clean inputs, through the fused op's
    conversion (stand-in) and through the fallback (float32: the reference)."""
    B, L, H, K = 1, 16, 2, 6
    monkeypatch.setattr(sa_npu, "GRAD_TOPK", K)
    q, kv, idx = _sfa_inputs(B, L, H, K, seed=5)  # documents 0 .. 6 and 7 .. 15
    if not fused:
        q, kv = q.float(), kv.float()
    assert (idx[:, 7:] < 0).any()
    bq, bkv = q.clone(), kv.clone()
    bkv[:, 0] = float("inf")
    bq[:, 2, 1] = float("nan")
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).to(q.dtype)

    def grads(q, kv):
        q, kv = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
        out = sa_npu.sparse_attention(q, kv, kv, idx, 0.05)
        return (out.detach(), *torch.autograd.grad(out, (q, kv), g))

    got, want = grads(bq, bkv), grads(q, kv)
    assert (fake_npu.calls != []) == fused
    for name, a, b in zip(("out", "dq", "dkv"), got, want, strict=True):
        a, b = a[:, 7:].float(), b[:, 7:].float()
        assert torch.isfinite(a).all(), f"{name}: a non-finite value left document 0"
        torch.testing.assert_close(a, b, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "change, reason",
    [
        ("float32", "dtype"),
        ("separate_v", "separate K and V"),
        ("head_dim", "head dim 64"),
        ("heads", "3 query heads"),
        ("grad_topk", "backward with k=6"),
    ],
)
def test_sparse_attention_falls_back_outside_limits(fake_npu, caplog, change, reason):
    B, L, H, K = 1, 12, 2, 6
    q, kv, idx = _sfa_inputs(B, L, H, K, seed=2)
    k = v = kv
    if change == "float32":
        q, k = q.float(), kv.float()
        v = k
    elif change == "separate_v":
        v = kv.clone()
    elif change == "head_dim":
        q, k = q[..., :64].contiguous(), kv[..., :64].contiguous()
        v = k
    elif change == "heads":
        q = torch.cat([q, q[:, :, :1]], dim=2)
    else:
        q.requires_grad_(True)
    with caplog.at_level(logging.WARNING, logger="wanka.ops.npu"):
        for _ in range(2):
            out = sa_npu.sparse_attention(q, k, v, idx, 0.1)
    assert fake_npu.calls == []
    assert torch.equal(out, sa_ref.sparse_attention(q, k, v, idx, 0.1))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and reason in lines[0] and "sparse_attention" in lines[0]


# --- registry ---------------------------------------------------------------------------


def test_registry_never_picks_npu_on_cpu(fake_npu):
    for op in ("sparse_attention", "lightning_indexer"):
        b = ops.registry.backends(op)["npu"]
        assert b.device_types == ("npu",) and b.available()  # torch_npu imports here
        assert ops.select(op, "cpu").name == "cpu"
        assert ops.select(op, "npu").name == "npu"


def test_npu_backends_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # `import torch_npu` fails
    for op in ("sparse_attention", "lightning_indexer"):
        assert not ops.registry.backends(op)["npu"].available()
        assert ops.select(op, "npu").name == "reference"
        assert ops.select(op, "cpu").name == "cpu"


# --- MLA's latent form ------------------------------------------------------------------


def _mla_inputs(B, L, H, K, seed=0, latent=512, rope=64):
    from wanka.ops.index_patterns import random_indices

    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, L, H, latent + rope, generator=g) * 0.1).to(BF16)
    kv = torch.randn(B, L, latent + rope, generator=g).to(BF16)
    idx = random_indices(B, L, K, doc_ids=_docs(B, L, (7,)), seed=seed)
    return q, kv, idx.gather(-1, torch.rand(idx.shape, generator=g).argsort(-1))


def test_mla_latent_form_runs_the_fused_op_with_its_rope_parts(fake_npu, monkeypatch):
    """q and kv of 512 + 64: the fused op gets the latent as query / key (= value) and the
    RoPE parts as query_rope / key_rope; output and gradients equal the definition (attention
    over the whole key, value = the key, output's latent part)."""
    from wanka.ops.mla_sparse_attention import npu as mla_npu
    from wanka.ops.mla_sparse_attention import reference as mla_ref

    B, L, H, K = 1, 15, 2, 5
    monkeypatch.setattr(sa_npu, "GRAD_TOPK", K)
    q, kv, idx = _mla_inputs(B, L, H, K, seed=1)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out = mla_npu.mla_sparse_attention(q, kv, idx, 0.05, 64)
    assert out.shape == (B, L, H, 512) and out.dtype == BF16
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(BF16)
    g = torch.autograd.grad(out, (q, kv), go)
    qr, kvr = (x.detach().float().requires_grad_(True) for x in (q, kv))
    ref = mla_ref.mla_sparse_attention(qr, kvr, idx, 0.05, 64)
    g_r = torch.autograd.grad(ref, (qr, kvr), go.float())
    assert fake_npu.calls == ["npu_sparse_flash_attention", "npu_sparse_flash_attention_grad"]
    torch.testing.assert_close(out.float(), ref, **VAL_TOL)
    # dkv: the latent gets its K-side and V-side gradients, the RoPE key its K-side one.
    for name, a, b in zip(("dq", "dkv"), g, g_r, strict=True):
        torch.testing.assert_close(a.float(), b, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")
        assert b[..., 512:].abs().sum() > 0  # the RoPE parts carry gradient: not zeroed


@pytest.mark.parametrize("change, reason", [("rope", "rope dim 32"), ("latent", "head dim 64"),
                                            ("float32", "dtype")])  # fmt: skip
def test_mla_latent_form_falls_back_outside_limits(fake_npu, caplog, change, reason):
    from wanka.ops.mla_sparse_attention import npu as mla_npu
    from wanka.ops.mla_sparse_attention import reference as mla_ref

    dims = {"rope": (512, 32), "latent": (64, 64)}.get(change, (512, 64))
    q, kv, idx = _mla_inputs(1, 12, 2, 6, seed=2, latent=dims[0], rope=dims[1])
    if change == "float32":
        q, kv = q.float(), kv.float()
    with caplog.at_level(logging.WARNING, logger="wanka.ops.npu"):
        out = mla_npu.mla_sparse_attention(q, kv, idx, 0.1, dims[1])
    assert fake_npu.calls == []
    ref = mla_ref.mla_sparse_attention(q, kv, idx, 0.1, dims[1])  # generic: the CPU backend
    torch.testing.assert_close(out.float(), ref.float(), **VAL_TOL)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and reason in lines[0] and "mla_sparse_attention" in lines[0]


def test_an_mla_layer_of_deepseek_v32_dims_reaches_the_fused_op(monkeypatch):
    """An MLA layer with kv_lora_rank 512 and qk_rope_head_dim 64 (the production flavor's)
    calls the latent form in the sparse phase, with arguments the NPU backend takes once in
    bfloat16 (on an NPU the model runs in bf16)."""
    from wanka.config.schema import ModelConfig
    from wanka.models.attention import make_ropes
    from wanka.models.mla import MLAttention
    from wanka.ops.mla_sparse_attention import npu as mla_npu

    cfg = ModelConfig(attention="mla", dim=64, n_heads=4, q_lora_rank=32, kv_lora_rank=512,
                      qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, index_topk=8,
                      n_index_heads=2, index_head_dim=64, max_seq_len=64)  # fmt: skip
    layer = MLAttention(cfg, has_indexer=True)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    seen = []
    real_call = ops.registry.call

    def spy(op, *args, **kwargs):
        seen.append((op, args))
        return real_call(op, *args, **kwargs)

    monkeypatch.setattr(ops.registry, "call", spy)
    monkeypatch.setattr(ops, "call", spy)
    L = 16
    x, pos = torch.randn(1, L, 64), torch.arange(L)[None]
    layer(x, pos, torch.zeros(1, L, dtype=torch.long), make_ropes(cfg), None, "sparse")
    calls = [a for op, a in seen if op == "mla_sparse_attention"]
    assert len(calls) == 1 and "sparse_attention" not in [op for op, _ in seen]
    q, kv, idx, _scale, rope = calls[0]
    assert q.shape == (1, L, 4, 576) and kv.shape == (1, L, 576) and rope == 64
    assert mla_npu.unsupported(q.to(BF16), kv.to(BF16), idx, rope, needs_grad=False) is None
    # Training too, where the grad op's k (2048 in production, as x25-293b's index_topk) is
    # the layer's own.
    monkeypatch.setattr(sa_npu, "GRAD_TOPK", cfg.index_topk)
    assert mla_npu.unsupported(q.to(BF16), kv.to(BF16), idx, rope, needs_grad=True) is None
    assert "q width" in mla_npu.unsupported(q[..., :-1].to(BF16), kv.to(BF16), idx, rope, False)
