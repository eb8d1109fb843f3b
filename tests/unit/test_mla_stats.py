"""MLA's FLOPs (bench/flops.py) by independent counts: by hand for a config small enough, and
with torch's FlopCounterMode over the MLA layer's own matmuls and its attention op."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from wanka.bench.flops import core_flops_per_key, flops_breakdown, flops_per_token
from wanka.config.schema import ModelConfig
from wanka.models.attention import make_ropes
from wanka.models.flavors import FLAVORS
from wanka.models.stats import count_params
from wanka.models.transformer import Transformer
from wanka.ops.mla_sparse_attention.reference import mla_sparse_attention

# Small enough to count by hand (test_flops_hand_computed in test_bench.py is its MQA twin).
HAND = ModelConfig(
    flavor="hand", attention="mla", vocab_size=16, dim=8, n_layers=2, n_heads=2,
    q_lora_rank=6, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
    tie_embeddings=True, n_index_heads=1, index_head_dim=4, index_topk=4, index_share_every=2,
    n_dense_layers=1, dense_hidden=16, n_experts=4, n_active_experts=2, expert_hidden=8,
    n_shared_experts=1, mtp_depth=1, max_seq_len=64,
)  # fmt: skip
# Widths all distinct, for the counted tests.
SMALL_MLA = ModelConfig(attention="mla", n_layers=2, n_heads=4, q_lora_rank=24, kv_lora_rank=20,
                        qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, n_index_heads=3,
                        index_head_dim=8, index_topk=12, max_seq_len=64)  # fmt: skip


def test_mla_flops_hand_computed():
    # Matmul params per token:
    #   attention per layer: wq_a 8x6 + wq_b 6x(2*(2+2)) + wkv_a 8x(4+2) + wkv_b 4x(2*(2+3))
    #     + wo (2*3)x8 = 48 + 48 + 48 + 40 + 48 = 232, two layers                  -> 464
    #     (the absorption einsums are wkv_b's matmuls: counted here, once per token)
    #   indexer (layer 0 only): wq_b 6x4 (from the q latent) + wk 8x4 + weights 8x1  ->  64
    #   layer 0 dense SwiGLU 3 x 8 x 16                                             -> 384
    #   layer 1 MoE: router 8x4 + 2 of 4 experts 2 x 3x8x8 + shared 3x8x8           -> 608
    #   MTP: proj 16x8 + dense-only block (attention 232 + SwiGLU 384)              -> 744
    #   tied head 16x8, used for main logits and MTP logits: 2 x 128                -> 256
    p = 464 + 64 + 384 + 608 + 744 + 256
    assert p == 2520
    # Per key, both heads: q.k over latent 4 + rope 2, p.v over the latent 4: 2 x 2 x 10.
    per_key = 2 * 2 * (4 + 2 + 4)
    assert core_flops_per_key(HAND) == per_key == 40
    # L = 16 > k = 4: sparse. Mean keys per query = (4*5/2 + 12*4) / 16 = 3.625.
    core = 2 * per_key * 3.625
    mtp = per_key * 3.625  # the MTP block attends sparsely too (the last selection)
    index = 2 * 1 * 4 * (17 / 2)  # one indexer layer over all visible keys
    expected = 3 * (2 * p + core + mtp + index)
    assert expected == 16629
    assert flops_per_token(HAND, 16) == pytest.approx(expected, rel=1e-12)
    b = flops_breakdown(HAND, 16)
    assert (b["matmul_params"], b["attention_fwd"], b["indexer_fwd"]) == (p, core + mtp, index)
    # L <= k: dense causal in every layer.
    assert flops_breakdown(HAND, 4)["attention_fwd"] == (2 + 1) * per_key * (5 / 2)


def _layer(cfg: ModelConfig):
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model.layers["0"].attention


def test_mla_matmuls_outside_the_core_are_its_params_once_per_token():
    """Every matmul of an MLA layer besides the attention op (projections, indexer, the two
    absorption einsums through wkv_b) is 2 x the layer's matrix parameters per token: what
    flops_breakdown's 2 P counts, so the einsums need no term of their own."""
    cfg = SMALL_MLA
    att = _layer(cfg)
    B, L = 2, 16
    x = torch.randn(B, L, cfg.dim)
    pos = torch.arange(L).expand(B, L)
    Dk = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        att._project(x, pos, make_ropes(cfg))
        att._output(torch.randn(B, L, cfg.n_heads, Dk))
    mats = sum(p.numel() for p in att.parameters() if p.dim() == 2)
    assert fc.get_total_flops() == 2 * B * L * mats
    # ...and the absorbed form's einsums alone are wkv_b's 2 x params per token.
    w = att.wkv_b.weight.numel()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        q = torch.randn(B, L, cfg.n_heads, cfg.qk_nope_head_dim)
        torch.einsum("blhn,hnc->blhc", q, att._wkv_b()[:, : cfg.qk_nope_head_dim])
        att._output(torch.randn(B, L, cfg.n_heads, Dk))
    assert fc.get_total_flops() - 2 * B * L * att.wo.weight.numel() == 2 * B * L * w


def test_mla_core_attention_counts_qk_over_the_key_and_pv_over_the_latent():
    """The latent-form op's definition (K = V: scores and values over the whole [latent | rope
    key]) counted with every slot valid: q.k and p.v over kv_lora_rank + rope per head. MLA
    reads the latent part only, so the model FLOPs leave out p.v's rope dims; the per-token
    total then follows the visible keys counted one query at a time."""
    cfg = SMALL_MLA
    H, r, C = cfg.n_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    B, L, K = 1, 24, cfg.index_topk
    q, kv = torch.randn(B, L, H, C + r), torch.randn(B, L, C + r)
    indices = torch.randint(0, L, (B, L, K))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        out = mla_sparse_attention(q, kv, indices, 0.1, r)
    assert out.shape[-1] == C
    counted = fc.get_total_flops() / (B * L * K)
    assert counted == 2 * H * (C + r) * 2
    assert core_flops_per_key(cfg) == counted - 2 * H * r
    for L in (K // 2, 5 * K):  # dense, sparse
        keys = sum(min(K, t + 1) if L > K else t + 1 for t in range(L)) / L
        want = core_flops_per_key(cfg) * (cfg.n_layers + cfg.mtp_depth) * keys
        assert flops_breakdown(cfg, L)["attention_fwd"] == pytest.approx(want, rel=1e-12)


def test_mqa_core_per_key_is_unchanged():
    small = FLAVORS["small"]
    assert core_flops_per_key(small) == 4 * small.n_heads * small.head_dim


def test_production_flavor_is_deepseek_v32_mla():
    x25 = FLAVORS["x25-293b"]
    assert x25.attention == "mla"
    assert (x25.q_lora_rank, x25.kv_lora_rank, x25.qk_nope_head_dim, x25.qk_rope_head_dim,
            x25.v_head_dim) == (1536, 512, 128, 64, 128)  # fmt: skip
    # the layout torch_npu's fused sparse attention takes: D = 512 + D_rope = 64
    assert x25.kv_lora_rank + x25.qk_rope_head_dim == 576
    c = count_params(x25)
    assert 290e9 < c.total < 293e9 and 28e9 < c.active < 30e9
    mqa = count_params(dataclasses.replace(x25, attention="mqa"))
    assert c.experts == mqa.experts  # only attention changed
