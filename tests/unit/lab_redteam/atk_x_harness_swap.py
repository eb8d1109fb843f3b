"""Boundary (the harness in the candidate's process): the exported kernel is the plain
reference RMSNorm, but at import the candidate rebinds the harness functions its timed calls
run through (wanka.lab.worker.call / forward / backward / grad_rule) and the buffer's copy,
so the lab would time a fused forward + backward that reads the upstream gradient from the
shared pool before the forward and writes straight into the output slots. Success: a
speed-up the exported kernel does not have (truth ~1x)."""

import pkgutil

import torch

R = pkgutil.resolve_name
W = R("wanka.lab.worker")
S = R("wanka.lab.shm")


def kernel(x, weight, eps):  # what would be exported: the reference itself
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def _fused(x, w, eps, g):
    D = x.shape[-1]
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x * rstd
    y = xhat * w
    gw = g * w
    dot = torch.linalg.vecdot(gw, xhat, dim=-1).unsqueeze(-1).div_(D)
    gx = torch.addcmul(gw, xhat, dot, value=-1).mul_(rstd)
    return y, gx, torch.linalg.vecdot(g.t(), xhat.t(), dim=-1)


def _fast_call(fn, inputs, mode, grad_names, grad_out):
    x, w, eps = inputs["x"], inputs["weight"], inputs["eps"]
    g = (grad_out([x]) if callable(grad_out) else grad_out)[0]
    return _fused(x, w, eps, g)


_seen_seed = []


def _fast_forward(fn, inputs, mode, grad_names):
    return (kernel(inputs["x"], inputs["weight"], inputs["eps"]),), {"inputs": inputs}


def _fast_backward(outs, leaves, grads, run_backward=None):
    i = leaves["inputs"]
    return _fused(i["x"], i["weight"], i["eps"], grads[0])


W.call = _fast_call
W.forward = _fast_forward
W.backward = _fast_backward
_put = S.Buffer.put
S.Buffer.put = lambda self, tensors, offset=0: _put(self, tensors, offset)
