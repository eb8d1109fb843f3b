"""Rotary embedding (half-split pairs, per-token positions) on CPU, one point of the lab's
variant space (the search rewrites CONFIG).

- impl: "cat" builds both halves and concatenates (the model's way); "out" writes the halves
  into one preallocated output; "complex" multiplies by e^{i theta} in complex arithmetic.
- backward: "autograd", or "manual": the gradient is the inverse rotation of the upstream
  gradient (a custom Function that saves only the table rows).
- upcast: compute in a float32 copy of x even when x is float32 already.
"""

import torch

CONFIG = {"impl": "cat", "backward": "autograd", "upcast": True}


def _cos_sin(x, table, positions):
    cs = table[positions]  # [B, L, D/2, 2]
    while cs.dim() < x.dim() + 1:
        cs = cs.unsqueeze(2)
    return cs[..., 0], cs[..., 1]


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    xf = x.float() if (CONFIG["upcast"] or x.dtype != torch.float32) else x
    x1, x2 = xf[..., :half], xf[..., half:]
    if CONFIG["impl"] == "complex":
        z = torch.view_as_complex(torch.stack([x1, x2], -1).contiguous())
        r = torch.view_as_real(z * torch.view_as_complex(torch.stack([cos, sin], -1).contiguous()))
        return torch.cat([r[..., 0], r[..., 1]], -1).to(x.dtype)
    if CONFIG["impl"] == "out":
        out = torch.empty(xf.shape, dtype=xf.dtype)
        torch.mul(x1, cos, out=out[..., :half])
        out[..., :half].sub_(x2 * sin)
        torch.mul(x1, sin, out=out[..., half:])
        out[..., half:].add_(x2 * cos)
        return out.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class _Manual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin), None, None


def kernel(x, table, positions):
    """x [B, L, H, D] rotated by table [max_len, D/2, 2] at positions [B, L]."""
    cos, sin = _cos_sin(x, table, positions)
    if CONFIG["backward"] == "manual" and torch.is_grad_enabled():
        return _Manual.apply(x, cos, sin)
    return _rotate(x, cos, sin)
