"""Boundary (autograd in the candidate's process): the exported kernel is the plain
reference RMSNorm, but at import the candidate replaces torch.autograd.backward with a closed
form of RMSNorm's gradients (no autograd engine), which only this harness ever calls: the
lab would time a backward that the exported kernel does not have. Success: "correct" with a
speed-up (truth ~1x); the lab must reject the replacement."""

import pkgutil

import torch

A = pkgutil.resolve_name("torch.autograd")
_saved = {}


def kernel(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = y.to(x.dtype) * weight
    _saved[id(out)] = (x, weight, eps)
    return out


def _closed_form(tensors, grad_tensors=None, *args, **kwargs):
    (out,), (g,) = tensors, grad_tensors
    x, w, eps = _saved.pop(id(out))
    with torch.no_grad():
        D = x.shape[-1]
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        xhat = x * rstd
        gw = g * w
        dot = torch.linalg.vecdot(gw, xhat, dim=-1).unsqueeze(-1).div_(D)
        x.grad = torch.addcmul(gw, xhat, dot, value=-1).mul_(rstd)
        w.grad = torch.linalg.vecdot(g.t(), xhat.t(), dim=-1)


A.backward = _closed_form
