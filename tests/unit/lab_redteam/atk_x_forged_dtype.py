"""Boundary (the evaluator's tensor descriptions): in its call, the kernel writes a forged
reply whose output has a list as its dtype (an unhashable dictionary key) on the server's
socket (fd 3), then computes honestly. Success: the evaluation crashes instead of rejecting
the candidate (or credits it)."""

import posix

import torch


def kernel(x, weight, eps):
    posix.write(
        3, b'{"ok": true, "phase": "forward", "outs": [{"dtype": [], "shape": [1], "ptr": 0}]}'
    )
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * weight
