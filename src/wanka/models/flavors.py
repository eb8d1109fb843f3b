"""Model presets. `tiny` is the demo, `small` (~100M) is for benchmarks, `x25-293b` is the
production shape (~292B total / ~29B active, MLA attention as DeepSeek-V3.2's), which is
built only on the meta device here."""

from __future__ import annotations

from wanka.config.schema import ModelConfig

FLAVORS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(flavor="tiny", bias_update_rate=1e-2),
    "small": ModelConfig(
        flavor="small", vocab_size=256, dim=512, n_layers=8, n_heads=8, head_dim=64,
        n_index_heads=4, index_head_dim=32, index_topk=256, index_share_every=2,
        n_dense_layers=1, dense_hidden=1536, n_experts=16, n_active_experts=2,
        expert_hidden=512, n_shared_experts=1, mtp_depth=1, max_seq_len=32768,
    ),
    "x25-293b": ModelConfig(
        flavor="x25-293b", vocab_size=157184, dim=6144, n_layers=48, n_heads=64,
        head_dim=128, tie_embeddings=False, n_index_heads=64, index_head_dim=128,
        # DeepSeek-V3.2's MLA (models/mla.py; head_dim is MQA's and unused): attention runs
        # over K = V = [latent 512 | RoPE key 64], the layout of torch_npu's fused sparse
        # attention (D 512 + D_rope 64).
        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
        index_topk=2048, index_share_every=4, n_dense_layers=3, dense_hidden=16384,
        n_experts=160, n_active_experts=10, expert_hidden=2112, n_shared_experts=2,
        mtp_depth=1, max_seq_len=131072,
        # DeepSeek-V3's routing and balancing: node-limited routing (8 groups of 20 experts,
        # e.g. one per node under ep, each token uses at most 4 of them) and the sequence-wise
        # auxiliary balance loss with its alpha = 1e-4, beside the aux-loss-free bias.
        n_expert_groups=8, n_limited_groups=4, seq_balance_loss_weight=1e-4,
    ),
}  # fmt: skip
