"""Parameter counts and a per-device memory estimate for a parallel layout (no allocation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wanka.config.schema import ModelConfig
from wanka.models.transformer import Transformer

GIB = 1024**3


@dataclass
class ParamCounts:
    total: int
    active: int  # per token: non-expert params + the routed experts a token actually uses
    experts: int
    embedding: int


def count_params(cfg: ModelConfig) -> ParamCounts:
    with torch.device("meta"):
        model = Transformer(cfg)
    total = experts = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:
            experts += p.numel()
    active = total - experts + experts * cfg.n_active_experts // cfg.n_experts
    return ParamCounts(total, active, experts, model.tok_embeddings.weight.numel())


def memory_estimate(
    cfg: ModelConfig,
    dp_shard: int,
    ep: int,
    seq_len: int,
    micro_batch_size: int,
    activation_checkpointing: bool = True,
    param_bytes: int = 2,
) -> dict[str, float]:
    """GiB per device for FSDP2 (all params sharded over dp_shard; experts over ep x dp/ep),
    fp32 master weights + grads + AdamW moments, bf16 compute copies of the layers being
    gathered (two in flight with prefetch), and activations. The activation term is a
    first-order model (saved tensors per token per layer), calibrated on nothing yet: treat it
    as a planning figure, not a promise."""
    counts = count_params(cfg)
    state = counts.total * (4 + 4 + 8) / dp_shard  # master, grad, exp_avg, exp_avg_sq
    per_layer_dense = (counts.total - counts.experts - 2 * counts.embedding) / max(cfg.n_layers, 1)
    per_layer_experts = counts.experts / max(cfg.n_layers - cfg.n_dense_layers, 1) / ep
    gathered = 2 * (per_layer_dense + per_layer_experts) * param_bytes
    tokens = seq_len * micro_batch_size
    k = min(cfg.index_topk, seq_len)
    n_indexers = -(-cfg.n_layers // cfg.index_share_every)
    per_token_layer = (
        cfg.dim * 10 * param_bytes  # norms, residuals, projections' inputs
        + cfg.n_heads * cfg.head_dim * 3 * param_bytes  # q, attention output, grad buffers
        + cfg.n_active_experts * cfg.expert_hidden * 3 * param_bytes  # routed expert hiddens
    )
    if activation_checkpointing:
        acts = tokens * cfg.dim * param_bytes * cfg.n_layers + tokens * per_token_layer
    else:
        acts = tokens * per_token_layer * cfg.n_layers
    indices = tokens * k * 8 * n_indexers  # int64 top-k indices kept for backward
    logits = tokens * cfg.vocab_size * 4 * 2
    out = {
        "params_and_optimizer": state / GIB,
        "gathered_layers": gathered / GIB,
        "activations": acts / GIB,
        "topk_indices": indices / GIB,
        "logits": logits / GIB,
    }
    out["total"] = sum(out.values())
    return out
