"""Sparse attention in Triton (CUDA): the backend's kernels launched with one point of the
lab's variant space: slots per tile (BLOCK_K), warps per program and pipeline stages.
The search proposer rewrites the CONFIG line."""

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.sparse_attention import triton as tri
from wanka.ops.triton_common import dot_precision, pow2

CONFIG = {"block_k": 32, "num_warps": 4, "num_stages": 2}


def _launch():
    return {"num_warps": CONFIG["num_warps"], "num_stages": CONFIG["num_stages"]}


def _forward(q, k, v, indices, scale):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    out = new_output((B, L, H, D), q.dtype, q.device)
    lse = new_output((B, L, H), torch.float32, q.device)
    indices = indices.contiguous()
    tri._fwd_kernel[(B * L,)](
        q, k, v, indices, out, lse, float(scale),
        *q.stride(), *k.stride(), *v.stride(), indices.stride(0), indices.stride(1),
        *out.stride(), *lse.stride(), L, H, D, K,
        BLOCK_H=pow2(H), BLOCK_D=pow2(D), BLOCK_K=pow2(CONFIG["block_k"]),
        PREC=dot_precision(q.dtype), **_launch(),
    )  # fmt: skip
    return out, lse


def _backward(q, k, v, indices, out, lse, dout, scale):
    B, L, H, D = q.shape
    K = indices.shape[-1]
    dq = new_output((B, L, H, D), q.dtype, q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    indices = indices.contiguous()
    tri._bwd_kernel[(B * L,)](
        q, k, v, indices, dout, lse, delta, dq, dk, dv, float(scale),
        *q.stride(), *k.stride(), *v.stride(), indices.stride(0), indices.stride(1),
        *dout.stride(), *lse.stride(), *dq.stride(), *dk.stride(), L, H, D, K,
        BLOCK_H=pow2(H), BLOCK_D=pow2(D), BLOCK_K=pow2(CONFIG["block_k"]),
        PREC=dot_precision(q.dtype), **_launch(),
    )  # fmt: skip
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale):
        out, lse = _forward(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, indices, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, indices, out, lse, dout.contiguous(), ctx.scale)
        return dq, dk, dv, None, None


def kernel(q, k, v, indices, scale):
    return _Fn.apply(q, k, v, indices, float(scale))
