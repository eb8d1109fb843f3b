"""MLA's latent-form sparse attention on Ascend NPUs: torch_npu's fused SparseFlashAttention
in its MLA-absorb mode, which is exactly this form when the latent is 512 wide and the RoPE
part 64 (DeepSeek-V3.2's kv_lora_rank and qk_rope_head_dim): the query and the key are split
into their latent and RoPE parts (`query` / `query_rope`, `key` / `key_rope`), the value is the
key's latent. Limits, layouts and the index conversion are those of
ops/sparse_attention/npu.py (`unsupported`), checked on the latent part; anything outside them
runs the generic backend (the device's best `sparse_attention`), with one log line per reason.
"""

from __future__ import annotations

import torch

from wanka.ops.mla_sparse_attention import reference
from wanka.ops.npu_common import fallback_once, has_torch_npu
from wanka.ops.registry import register
from wanka.ops.sparse_attention import npu as sfa

OP = "mla_sparse_attention"


def unsupported(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, rope_dim: int,
                needs_grad: bool) -> str | None:  # fmt: skip
    """Why the fused op cannot take this call (None: it can)."""
    if q.shape[-1] != kv.shape[-1]:
        return f"q width {q.shape[-1]} != kv width {kv.shape[-1]}"
    if rope_dim != sfa.ROPE_DIM:
        return f"rope dim {rope_dim}: the fused op takes {sfa.ROPE_DIM}"
    latent = kv[..., : kv.shape[-1] - rope_dim]
    return sfa.unsupported(q[..., : latent.shape[-1]], latent, latent, indices, needs_grad)


def supports(q, kv, indices, scale, rope_dim, *_args, **_kwargs) -> str | None:
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    return unsupported(q, kv, indices, rope_dim, needs_grad)


@register(OP, "npu", device_types=("npu",), priority=20, available=has_torch_npu, supports=supports)
def mla_sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                         rope_dim: int) -> torch.Tensor:  # fmt: skip
    why = "torch_npu does not import" if not has_torch_npu() else None
    why = why or supports(q, kv, indices, scale, rope_dim)
    if why is not None:
        fallback_once(OP, why)
        return reference.via_sparse_attention(q, kv, indices, scale, rope_dim)
    C = kv.shape[-1] - rope_dim
    latent = kv[..., :C]
    return sfa.FusedSparseAttention.apply(q[..., :C], q[..., C:], latent, latent, kv[..., C:],
                                          indices, float(scale))  # fmt: skip
