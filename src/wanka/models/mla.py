"""DSA on multi-head latent attention (MLA): the DeepSeek-V3.2 form, `model.attention = "mla"`.

Queries and keys/values go through low-rank latents (q: dim -> q_lora_rank -> heads; kv: dim ->
kv_lora_rank, one latent shared by all heads, plus a decoupled RoPE key of qk_rope_head_dim).
As in DeepSeek-V3.2, attention runs in MQA mode over the latent: each head's no-RoPE query is
absorbed into the latent space through its slice of wkv_b, so every head attends to the same
key, [latent | rope key] (kv_lora_rank + qk_rope_head_dim wide), and the value is that same
tensor (K = V): the output's latent part is mapped back to each head's value space. The op
registry's attention ops therefore see plain MQA with k = v, and the sparse one is called in
its latent form (`mla_sparse_attention`: q, kv, rope_dim -> the latent part of the output),
the layout fused MLA kernels (FlashMLA, torch_npu's sparse flash attention) take. The KV
cache holds only the latent and the RoPE key (plus the indexer keys).

The lightning indexer reads the query latent (its queries) and the layer input (its keys
and head weights); RoPE covers the first qk_rope_head_dim dims of each indexer head.
Parameter names and layouts map one to one onto Hugging Face's `deepseek_v32`
(wanka/interop/hf.py), whose norms inside attention use eps 1e-6.
"""

from __future__ import annotations

import torch
from torch import nn

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.attention import Attention
from wanka.models.layers import Linear, RMSNorm, apply_rope

LATENT_NORM_EPS = 1e-6  # deepseek_v32's q/kv latent norms and indexer key norm


class MLAIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_index_heads, cfg.index_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_index_heads * cfg.index_head_dim, bias=False)
        self.wk = Linear(cfg.dim, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=LATENT_NORM_EPS)
        self.weights_proj = Linear(cfg.dim, cfg.n_index_heads, bias=False)

    def forward(self, x, q_latent, rope: torch.Tensor, positions: torch.Tensor):
        B, L, _ = x.shape
        r = self.rope_dim
        q = self.wq_b(q_latent).view(B, L, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x))
        q = torch.cat([apply_rope(q[..., :r], rope, positions), q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], rope, positions), k[..., r:]], dim=-1)
        # ReLU(q.k / sqrt(Di)) = ReLU(q.k) / sqrt(Di): scale the queries, the op stays as is.
        w = self.weights_proj(x) * self.n_heads**-0.5
        return q * self.head_dim**-0.5, k, w


class MLAttention(Attention):
    """Same interface as the MQA Attention (forward, CP, decode): only the projections into
    the MQA form and the output projection differ."""

    def __init__(self, cfg: ModelConfig, has_indexer: bool) -> None:
        nn.Module.__init__(self)
        H = cfg.n_heads
        self.n_heads, self.topk = H, cfg.index_topk
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_rank = cfg.kv_lora_rank
        self.scale = (self.nope + self.rope_dim) ** -0.5  # the per-head q.k width
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
        self.wq_b = Linear(cfg.q_lora_rank, H * (self.nope + self.rope_dim), bias=False)
        self.wkv_a = Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = Linear(H * self.v_dim, cfg.dim, bias=False)
        self.indexer = MLAIndexer(cfg) if has_indexer else None

    def _project(self, x, positions, ropes):
        """-> absorbed queries [B, L, H, kv_rank + rope], k = v = [latent | rope key]
        [B, L, kv_rank + rope] (one tensor), the indexer's (q, k, w) or Nones."""
        B, L, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(B, L, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, ropes["attn"], positions)
        k_rope = apply_rope(k_rope, ropes["attn"], positions)
        w_uk = self._wkv_b()[:, : self.nope]  # [H, nope, kv_rank]
        q_abs = torch.cat([torch.einsum("blhn,hnc->blhc", q_nope, w_uk), q_rope], dim=-1)
        kv = torch.cat([self.kv_norm(latent), k_rope], dim=-1)
        qi = ki = wi = None
        if self.indexer is not None:  # detached inputs: the indexer never trains the model
            qi, ki, wi = self.indexer(x.detach(), q_latent.detach(), ropes["attn"], positions)
        return q_abs, kv, kv, qi, ki, wi

    def _sparse(self, q, k, v, indices) -> torch.Tensor:
        """k is v = [latent | rope key]: the latent form, whose output is the latent part only
        (`mla_sparse_attention`; on Ascend with kv_lora_rank 512 and qk_rope_head_dim 64 it is
        torch_npu's fused sparse attention)."""
        return ops.call("mla_sparse_attention", q, k, indices, self.scale, self.rope_dim)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """[B, L, H, kv_rank + rope] attention over k = v (or [B, L, H, kv_rank], its latent
        part, from the sparse op) -> the latent part, through each head's value slice of
        wkv_b, then wo."""
        B, L = out.shape[:2]
        w_uv = self._wkv_b()[:, self.nope :]  # [H, v, kv_rank]
        o = torch.einsum("blhc,hvc->blhv", out[..., : self.kv_rank], w_uv)
        return self.wo(o.reshape(B, L, -1))

    def _wkv_b(self) -> torch.Tensor:
        return self.wkv_b.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
