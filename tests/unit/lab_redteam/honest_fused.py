"""An honest candidate that is genuinely faster than the baseline: one reduction pass for
the statistics (vector_norm), in-place scaling, and a hand-written backward that reuses the
saved 1/rms instead of autograd's chain of pow/mean/rsqrt/mul backward kernels."""

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        d = x.shape[-1]
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rstd = rstd.square_().div_(d).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return torch.mul(x, rstd).mul_(weight)

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        d = x.shape[-1]
        xhat = x * rstd
        dw = (g * xhat).sum(0)
        gw = g * weight
        dot = torch.linalg.vecdot(gw, xhat).unsqueeze(-1).div_(d)
        dx = gw.sub_(xhat.mul_(dot)).mul_(rstd)
        return dx, dw, None


def kernel(x, weight, eps):
    return _RMSNorm.apply(x, weight, eps)
