"""RMSNorm on CPU, one point of the lab's variant space (the search rewrites CONFIG).

- impl: "upcast" computes in a float32 copy (the model's way); "native" skips the copy
  for float32 inputs; "fused" calls torch's rms_norm kernel.
- backward: "autograd", or "manual": a custom Function saving only x and 1/rms,
  dx = rstd * (g*w - xhat * mean(g*w*xhat)), dw = sum over rows of g * xhat.
- rows: rows per block (0 = all at once): blocks that stay in cache vs loop overhead.
- inv: rsqrt, or 1 / sqrt.
"""

import torch

CONFIG = {"impl": "upcast", "backward": "autograd", "rows": 0, "inv": "rsqrt"}


def _rstd(xf, eps):
    ms = xf.pow(2).mean(-1, keepdim=True) + eps
    return torch.rsqrt(ms) if CONFIG["inv"] == "rsqrt" else 1.0 / torch.sqrt(ms)


def _forward(x, weight, eps):
    if CONFIG["impl"] == "fused":
        y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
        return y.to(x.dtype) * weight
    xf = x if (CONFIG["impl"] == "native" and x.dtype == torch.float32) else x.float()
    return (xf * _rstd(xf, eps)).to(x.dtype) * weight


class _Manual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = _rstd(xf, eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        gw = g.float() * weight.float()
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = (g.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def _one(x, weight, eps):
    if CONFIG["backward"] == "manual" and torch.is_grad_enabled():
        return _Manual.apply(x, weight, eps)
    return _forward(x, weight, eps)


def kernel(x, weight, eps):
    """x [N, D], weight [D] -> [N, D]."""
    R = CONFIG["rows"]
    if not R or x.shape[0] <= R:
        return _one(x, weight, eps)
    return torch.cat([_one(x[i : i + R], weight, eps) for i in range(0, x.shape[0], R)])
