"""DSA sparse attention on Ascend NPUs via torch_npu's fused SparseFlashAttention.

Calls `torch_npu.npu_sparse_flash_attention` (forward, `return_softmax_lse=True` when a
gradient is needed) and `torch_npu.npu_sparse_flash_attention_grad` (backward). Their
documented limits (torch_npu API reference `torch_npu-npu_sparse_flash_attention.md`, CANN
`aclnnSparseFlashAttentionGrad.md`), and what wanka does with each:

* only `attention_mode=2` (MLA-absorb): query/key head dim D = 512 plus a separate rope part
  (`query_rope` / `key_rope`, D_rope = 64), and key and value are the same data. wanka's
  sparse attention is MQA with one K and one V head of the same dim, so the fused op fits
  only when D == 512 and `v` is `k`; the rope inputs are passed as zeros, which add exactly 0
  to every score. Separate K and V (the MQA model) fall back. MLA layers call
  `mla_sparse_attention` instead, whose NPU backend hands the fused op their real rope parts
  (ops/mla_sparse_attention/npu.py).
* layouts BSND / TND; wanka uses BSND: q [B, L, H, D] as is, k [B, L, D] -> [B, L, 1, D]
  (KV_N = 1), indices [B, L, K] int64 -> [B, L, 1, K] int32, with the valid slots moved in
  front of the -1 slots (the op requires valid values first), order kept otherwise. The
  indices already encode causality and documents, so `sparse_mode=0` (no extra mask).
* query heads N1 in {1, 2, 4, ..., 128}; float16 / bfloat16 only; `sparse_block_size=1`
  (token-wise selection, wanka's indices are tokens).
* the grad op is documented for K = 2048 selected slots (GRAD_TOPK).

* queries as a suffix of the keys (Lq < Lk, context parallelism; `wanka.ops.registry`
  docstring): not taken (BSND with S1 != S2 is untested here).

`unsupported` is also this backend's registry `supports` check, so `registry.call` skips it
for anything outside the limits (a forced npu backend raises). Called directly, anything
else runs `reference.sparse_attention`, with one log line per reason. The layout
conversion is tested on CPU against a stand-in torch_npu (tests/unit/test_ops_npu.py); the
fused path itself has not run on Ascend hardware here.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.npu_common import fallback_once, has_torch_npu, load_torch_npu
from wanka.ops.registry import query_suffix_unsupported, register
from wanka.ops.sparse_attention import reference

OP = "sparse_attention"
HEAD_DIM = 512  # D of query / key / value (attention_mode=2)
ROPE_DIM = 64  # D_rope of query_rope / key_rope
HEADS = (1, 2, 4, 8, 16, 32, 64, 128)  # supported query head counts N1
DTYPES = (torch.float16, torch.bfloat16)
GRAD_TOPK = 2048  # K the grad op is documented for
ATTENTION_MODE = 2  # MLA-absorb, the only supported mode
SPARSE_MODE = 0  # no extra mask: the indices are already causal and document-aware


def unsupported(q, k, v, indices, needs_grad: bool) -> str | None:
    """Why the fused op cannot take these inputs (None: it can)."""
    B, L, H, D = q.shape
    why = query_suffix_unsupported(q, k)
    if why is not None:
        return why
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}: the fused op takes float16/bfloat16 q, k, v of one dtype"
    if D != HEAD_DIM:
        return f"head dim {D}: the fused op takes {HEAD_DIM} (MLA-absorb mode only)"
    if H not in HEADS:
        return f"{H} query heads: the fused op takes {HEADS}"
    if not _same_data(k, v):
        return "separate K and V: the fused op's only mode (MLA-absorb) reads V from K"
    if indices.shape[-1] < 1:
        return "no index slots"
    if needs_grad and indices.shape[-1] != GRAD_TOPK:
        return f"backward with k={indices.shape[-1]}: the grad op is documented for k={GRAD_TOPK}"
    return None


def supports(q, k, v, indices, *_args, **_kwargs) -> str | None:
    """The registry's per-call check: `unsupported` with the call's own gradient need."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    return unsupported(q, k, v, indices, needs_grad)


def _same_data(k: torch.Tensor, v: torch.Tensor) -> bool:
    return k is v or (
        k.shape == v.shape and k.stride() == v.stride() and k.data_ptr() == v.data_ptr()
    )


def to_npu_indices(indices: torch.Tensor) -> torch.Tensor:
    """[B, L, K] int64 (-1 anywhere) -> [B, L, 1, K] int32, valid slots first (stable)."""
    order = torch.sort((indices < 0).to(torch.int8), dim=-1, stable=True).indices
    return indices.gather(-1, order).to(torch.int32).unsqueeze(2).contiguous()


class FusedSparseAttention(torch.autograd.Function):
    """The fused op in its own terms: query [B, L, H, 512] and its rope part [B, L, H, 64],
    key = value data [B, L, 512] (passed as `key` and `value`, one tensor or views of one) and
    the key's rope part [B, L, 64] -> [B, L, H, 512], softmax over q.k + q_rope.k_rope of the
    selected keys, weights applied to the key (= value) rows. Shared by `sparse_attention`
    (MQA form with D = 512, rope parts zero) and `mla_sparse_attention` (MLA's latent form,
    ops/mla_sparse_attention/npu.py)."""

    @staticmethod
    def forward(ctx, q, q_rope, key, value, k_rope, indices, scale):
        npu = load_torch_npu()
        query, q_rope = q.contiguous(), q_rope.contiguous()
        kv = key.unsqueeze(2).contiguous()  # [B, L, 1, 512]; the fused op reads V from it
        k_rope = k_rope.unsqueeze(2).contiguous()
        idx = to_npu_indices(indices)
        need_lse = any(ctx.needs_input_grad[:5])
        out, smax, ssum = npu.npu_sparse_flash_attention(
            query, kv, kv, idx, scale,
            block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
            query_rope=q_rope, key_rope=k_rope, sparse_block_size=1,
            layout_query="BSND", layout_kv="BSND", sparse_mode=SPARSE_MODE,
            attention_mode=ATTENTION_MODE, return_softmax_lse=need_lse,
        )  # fmt: skip
        if need_lse:
            ctx.save_for_backward(query, kv, idx, out, smax, ssum, q_rope, k_rope)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        npu = load_torch_npu()
        query, kv, idx, out, smax, ssum, q_rope, k_rope = ctx.saved_tensors
        dq, dk, dv, dq_rope, dk_rope = npu.npu_sparse_flash_attention_grad(
            query, kv, kv, idx, dout.contiguous(), out, smax, ssum, ctx.scale, 1,
            query_rope=q_rope, key_rope=k_rope, actual_seq_qlen=None, actual_seq_kvlen=None,
            layout="BSND", sparse_mode=SPARSE_MODE, attention_mode=ATTENTION_MODE,
        )  # fmt: skip
        needs = ctx.needs_input_grad
        # key and value are one tensor: autograd adds the K-side and V-side gradients.
        grads = (dq, dq_rope, dk.squeeze(2), dv.squeeze(2), dk_rope.squeeze(2))
        return (*(g if n else None for g, n in zip(grads, needs)), None, None)


@register(OP, "npu", device_types=("npu",), priority=20, available=has_torch_npu, supports=supports)
def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same contract as `reference.sparse_attention`: q [B, L, H, D]; k, v [B, L, D];
    indices [B, L, K] int64 (-1 = empty slot) -> [B, L, H, D]."""
    why = "torch_npu does not import" if not has_torch_npu() else None
    why = why or supports(q, k, v, indices)
    if why is not None:
        fallback_once(OP, why)
        return reference.sparse_attention(q, k, v, indices, scale)
    B, L, H, _ = q.shape
    q_rope, k_rope = q.new_zeros(B, L, H, ROPE_DIM), q.new_zeros(B, L, ROPE_DIM)
    return FusedSparseAttention.apply(q, q_rope, k, v, k_rope, indices, float(scale))
