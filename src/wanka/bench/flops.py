"""Model FLOPs per trained token and a measured matmul peak, for MFU.

MFU = (model FLOPs per token x tokens/s) / peak FLOP/s. The numerator counts the FLOPs the model
*needs* (the usual "model FLOPs" convention: no recomputation, no indexer KL-target recompute,
no elementwise work), the denominator is what this machine's fp32 matmul actually reaches,
not a datasheet number (CPU training runs fp32, see wanka.device.autocast_dtype).
"""

from __future__ import annotations

import statistics
import time

import torch

from wanka.config.schema import ModelConfig


def _vector_params(cfg: ModelConfig) -> int:
    """Parameters that do no matmul: norm gains and biases (every 1-D parameter)."""
    from wanka.models.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters() if p.dim() < 2)


def core_flops_per_key(cfg: ModelConfig) -> int:
    """Forward FLOPs of core attention per (query token, attended key), all query heads.

    MQA (models/attention.py): q.k and p.v over head_dim: 2 x 2 h d.
    MLA (models/mla.py, MQA mode over the latent): q.k over the absorbed query and the one key
    [latent | rope key], kv_lora_rank + qk_rope_head_dim wide; p.v over the latent only,
    kv_lora_rank: the value is that same tensor (K = V), but MLA reads only the output's
    latent part (`mla_sparse_attention` returns only it and fused kernels skip the rest; the
    generic backend and dense_attention compute the rope dims too, overhead not counted).
    FlashMLA counts 2 h (576 + 512) per key the same way.
    """
    if cfg.attention == "mla":
        qk = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return 2 * cfg.n_heads * (qk + cfg.kv_lora_rank)
    return 2 * 2 * cfg.n_heads * cfg.head_dim


def _mean_min(k: int, L: int) -> float:
    """Mean over query positions t = 1..L of min(k, t): keys a causal query sees, capped at k."""
    k = min(k, L)
    return (k * (k + 1) / 2 + (L - k) * k) / L


def flops_breakdown(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by component, plus `total` = 3 x forward (see flops_per_token)."""
    from wanka.models.stats import count_params

    L = seq_len
    c = count_params(cfg)
    head = cfg.vocab_size * cfg.dim
    # Active params minus the embedding lookup (a gather, no FLOPs) and the untied output head
    # (counted below), minus norm vectors; then the head once per logits computation: the main
    # output plus one per MTP depth (MTP shares the head).
    untied_head = 0 if cfg.tie_embeddings else head
    matmul_params = (
        c.active - c.embedding - untied_head - _vector_params(cfg) + head * (1 + cfg.mtp_depth)
    )

    causal = (L + 1) / 2  # mean visible keys per query, dense causal attention
    sparse = L > cfg.index_topk  # same rule as models/attention.py
    keys = _mean_min(cfg.index_topk, L) if sparse else causal
    per_key_core = core_flops_per_key(cfg)  # q.k and p.v, every query head
    core = cfg.n_layers * per_key_core * keys
    # MTP blocks attend as the main layers do (sparse on the last selection past k)
    mtp_core = cfg.mtp_depth * per_key_core * keys
    n_indexers = len([i for i in range(cfg.n_layers) if i % cfg.index_share_every == 0])
    indexer = n_indexers * 2 * cfg.n_index_heads * cfg.index_head_dim * causal

    out = {
        "matmul_params": float(matmul_params),
        "dense_fwd": 2.0 * matmul_params,
        "attention_fwd": float(core + mtp_core),
        "indexer_fwd": float(indexer),
    }
    out["forward"] = out["dense_fwd"] + out["attention_fwd"] + out["indexer_fwd"]
    out["total"] = 3.0 * out["forward"]
    return out


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), for a sequence of `seq_len` tokens.

        total   = 3 x forward                       (backward ~ 2 x forward)
        forward = 2 P  +  A_core  +  A_mtp  +  A_index

    P (matmul params): count_params(cfg).active - embedding table (the lookup is a gather) -
    output head if untied - norm gains/biases (1-D params), + vocab x dim x (1 + mtp_depth)
    because the head (tied or not) multiplies once for the main logits and once per MTP depth.
    Active params count only the n_active_experts routed experts a token uses, plus shared
    experts, routers, dense FFNs, attention and indexer projections and the MTP modules.

    A_core (main layers, L = seq_len, k = index_topk, h = n_heads, d = head_dim):
        n_layers x 4 h d x K,  with 4 h d = 2 FLOPs x (q.k + p.v) per key and query head
            (MLA: 2 h (kv_lora_rank + qk_rope_head_dim + kv_lora_rank) instead of 4 h d,
            q.k over [latent | rope key], p.v over the latent: core_flops_per_key)
        K = mean_t min(k, t) = (k(k+1)/2 + (L-k) k) / L    when L > k (DSA top-k: every layer
            attends to k keys, chosen by its own indexer or shared from the last indexer layer)
        K = (L+1)/2                                         when L <= k (dense causal)
    A_mtp: mtp_depth x 4 h d x K (MTP blocks attend as the main layers do: sparse on the
        main model's last selection when L > k; before 2026-12-05 this counted (L+1)/2 keys).
    A_index: layers with an indexer (layer_id % index_share_every == 0) score every visible
        key, sparse or not: n_indexers x 2 n_index_heads index_head_dim (L+1)/2.

    MLA's absorption einsums (each head's no-RoPE query into the latent through wkv_b's key
    slice, the output's latent part back through its value slice) cost 2 h (nope + v)
    kv_lora_rank per token, exactly 2 x wkv_b's parameters: they are wkv_b's matmuls, counted
    once per token in 2 P like every projection (as the textbook form, which applies wkv_b to
    each token's latent, would), and not again.

    For L >> k the core term per token tends to the constant n_layers 4 h d k, so the
    attention cost of a sequence grows linearly in L; the indexer term per token grows
    linearly in L (quadratic per sequence) and eventually dominates at long context.

    Conventions and known approximations: causal visibility over the whole packed sequence
    (document masking makes real attention cheaper, so this is an upper bound there);
    the 3x factor is applied to everything, though the indexer sees a detached input (no input
    gradient) and its backward only flows through the k selected scores; the indexer's per-head
    weighting and ReLU, softmax, norms, RoPE, routing top-k and the optimizer are not counted;
    the no-grad attention-probability target for the indexer KL is overhead, not model FLOPs.
    """
    return flops_breakdown(cfg, seq_len)["total"]


def measure_matmul_peak(
    seconds: float = 2.0, threads: int | None = None, sizes: tuple[int, ...] = (1024, 2048)
) -> float:
    """Measured fp32 matmul FLOP/s on this CPU with the current torch thread count (or
    `threads`, restored afterwards): square n x n @ n x n matmuls for each n in `sizes`, two
    warm-up calls, then repeated calls for about seconds / len(sizes) each (at least 3); each
    size gives the median of 2 n^3 / call time, and the best size is returned."""
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        best = 0.0
        budget = seconds / len(sizes)
        for n in sizes:
            a = torch.randn(n, n)
            b = torch.randn(n, n)
            out = torch.empty(n, n)
            for _ in range(2):
                torch.mm(a, b, out=out)
            rates: list[float] = []
            t_end = time.perf_counter() + budget
            while len(rates) < 3 or time.perf_counter() < t_end:
                t0 = time.perf_counter()
                torch.mm(a, b, out=out)
                dt = time.perf_counter() - t0
                rates.append(2.0 * n**3 / dt)
            best = max(best, statistics.median(rates))
        return best
    finally:
        torch.set_num_threads(old)
