"""MLA in MQA mode (absorbed queries, K = V latent) computes textbook multi-head latent
attention: per-head keys and values expanded from the latent."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from wanka import ops
from wanka.config import ConfigError, load_config
from wanka.config.schema import ModelConfig
from wanka.models.layers import apply_rope
from wanka.models.mla import MLAttention
from wanka.models.transformer import Transformer

CFG = ModelConfig(attention="mla", index_topk=12, max_seq_len=128, n_heads=4,
                  q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=6,
                  v_head_dim=10, n_index_heads=3, index_head_dim=8)  # fmt: skip


def _block_attention(seed: int = 0) -> tuple[Transformer, MLAttention]:
    with torch.device("meta"):
        model = Transformer(CFG)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-trivial norms, larger weights: real mixing across heads
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.05))
    return model, model.layers["0"].attention


def _textbook(att: MLAttention, x, positions, rope, allowed):
    """Per-head keys [nope | rope] and values from the latent; softmax over `allowed`."""
    B, L, _ = x.shape
    H, n, r, v = att.n_heads, att.nope, att.rope_dim, att.v_dim
    q = att.wq_b(att.q_norm(att.wq_a(x))).view(B, L, H, n + r)
    latent, k_rope = att.wkv_a(x).split([att.kv_rank, r], -1)
    kv = att.wkv_b(att.kv_norm(latent)).view(B, L, H, n + v)
    k_nope, val = kv.split([n, v], -1)
    q = torch.cat([q[..., :n], apply_rope(q[..., n:], rope, positions)], -1)
    k_rope = apply_rope(k_rope, rope, positions)[:, :, None].expand(B, L, H, r)
    k = torch.cat([k_nope, k_rope], -1)
    s = torch.einsum("blhd,bshd->bhls", q, k) * (n + r) ** -0.5
    p = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1)
    return att.wo(torch.einsum("bhls,bshv->blhv", p, val).reshape(B, L, -1))


@pytest.mark.parametrize("L", [10, 30])  # dense (L <= k = 12) and sparse
def test_absorbed_mla_is_textbook_mla(L):
    model, att = _block_attention()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, L, CFG.dim, generator=g)
    pos = torch.arange(L).expand(2, L)
    docs = torch.zeros(2, L, dtype=torch.long)
    ropes = {"attn": model.rope_attn, "index": model.rope_index}
    with torch.no_grad():
        out, aux = att(x, pos, docs, ropes, None, "sparse")
    allowed = torch.ones(L, L, dtype=torch.bool).tril().expand(2, L, L)
    if L > CFG.index_topk:  # the indexer's selection, as a mask
        sel = torch.zeros(2, L, L + 1, dtype=torch.bool)
        sel.scatter_(-1, aux.indices.masked_fill(aux.indices < 0, L), True)
        allowed = allowed & sel[..., :L]
        assert not sel[..., :L].all(), "nothing was left out: not a sparse case"
    want = _textbook(att, x, pos, model.rope_attn, allowed)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-4), (out - want).abs().max()


def test_mla_indexer_reads_the_query_latent_and_ropes_its_first_dims():
    """Moving a token changes only the RoPE part of its indexer key; the rest is position-free."""
    model, att = _block_attention()
    x = torch.randn(1, 5, CFG.dim)
    ropes = model.rope_attn
    q_lat = att.q_norm(att.wq_a(x))
    _, k0, _ = att.indexer(x, q_lat, ropes, torch.arange(5)[None])
    _, k1, _ = att.indexer(x, q_lat, ropes, torch.arange(5)[None] + 7)
    r = CFG.qk_rope_head_dim
    assert torch.equal(k0[..., r:], k1[..., r:]) and not torch.allclose(k0[..., :r], k1[..., :r])
    scores = ops.call("indexer_scores", *att.indexer(x, q_lat, ropes, torch.arange(5)[None])[:1],
                      k0, att.indexer(x, q_lat, ropes, torch.arange(5)[None])[2],
                      torch.zeros(1, 5, dtype=torch.long))  # fmt: skip
    assert torch.isfinite(scores[0].diagonal()).all()


def test_mla_cache_holds_the_latent_once():
    """The decode cache keeps [latent | rope key] (kv_lora_rank + qk_rope_head_dim wide) once,
    not a key and a value copy."""
    from wanka.infer.cache import KVCache

    model, _ = _block_attention()
    cache = KVCache(len(model.layers), 1, torch.device("cpu"))
    with torch.no_grad():
        model.decode(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, 0,
                     cache.set_docs(0, torch.zeros(1, 3, dtype=torch.long)))  # fmt: skip
    k, v, ki = cache.layers[0].tensors
    assert k.shape[-1] == CFG.kv_lora_rank + CFG.qk_rope_head_dim and v is None
    assert ki.shape[-1] == CFG.index_head_dim


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.q_lora_rank=0", "model.q_lora_rank"),
        ("model.qk_rope_head_dim=7", "model.qk_rope_head_dim"),
        ("model.index_head_dim=4", "model.index_head_dim"),
    ],
)
def test_bad_mla_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, ['model.attention="mla"', "model.qk_rope_head_dim=8", override])


def test_mla_changes_the_parameter_layout_only_where_it_should():
    mqa = dataclasses.replace(CFG, attention="mqa")
    with torch.device("meta"):
        a, b = Transformer(mqa), Transformer(CFG)
    names = lambda m: {n.split(".attention.")[0] for n, _ in m.named_parameters()}  # noqa: E731
    assert names(a) == names(b)
    assert "layers.0.attention.wkv_b.weight" in dict(b.named_parameters())
