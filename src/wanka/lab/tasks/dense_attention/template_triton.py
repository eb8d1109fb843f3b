"""Dense causal attention in Triton (CUDA): the backend's kernels launched with one point of
the lab's variant space: tile length, warps and pipeline stages (CONFIG)."""

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.common import new_output
from wanka.ops.dense_attention import triton as tri
from wanka.ops.triton_common import dot_precision, pow2, triton

CONFIG = {"block": 64, "num_warps": 4, "num_stages": 2}


def _cfg(q):
    return dict(BLOCK_M=pow2(CONFIG["block"]), BLOCK_N=pow2(CONFIG["block"]),
                BLOCK_D=pow2(q.shape[-1]), PREC=dot_precision(q.dtype),
                num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"])  # fmt: skip


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_ids, scale):
        B, L, H, D = q.shape
        doc = doc_ids.to(torch.int32).contiguous()
        start, end = tri._doc_bounds(doc)
        out = new_output((B, L, H, D), q.dtype, q.device)
        lse = new_output((B, H, L), torch.float32, q.device)
        c = _cfg(q)
        tri._fwd_kernel[(triton.cdiv(L, c["BLOCK_M"]), B * H)](
            q, k, v, doc, start, out, lse, float(scale), *q.stride(), *k.stride(),
            *v.stride(), *out.stride(), L, H, D, **c)  # fmt: skip
        ctx.save_for_backward(q, k, v, doc, start, end, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, doc, start, end, out, lse = ctx.saved_tensors
        B, L, H, D = q.shape
        dout = dout.contiguous()
        dq = new_output((B, L, H, D), q.dtype, q.device)
        dk, dv = new_output(k.shape, k.dtype, k.device), new_output(v.shape, v.dtype, v.device)
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
        c = _cfg(q)
        grid = triton.cdiv(L, c["BLOCK_M"])
        tri._bwd_dq_kernel[(grid, B * H)](
            q, k, v, doc, start, dout, lse, delta, dq, float(ctx.scale), *q.stride(),
            *k.stride(), *v.stride(), *dout.stride(), *dq.stride(), L, H, D, **c)  # fmt: skip
        tri._bwd_dkdv_kernel[(grid, B)](
            q, k, v, doc, end, dout, lse, delta, dk, dv, float(ctx.scale), *q.stride(),
            *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(), L, H, D, **c)  # fmt: skip
        return dq, dk, dv, None, None


def kernel(q, k, v, doc_ids, scale):
    return _Fn.apply(q, k, v, doc_ids, float(scale))
