"""Boundary (the evaluator's tensor descriptions): a forged forward description, a zero-element output whose other dims overflow torch's
storage-size computation. parse_description accepts it (every dim < 2**40, 0 bytes), then
read_remote's torch.empty raised RuntimeError, which escaped evaluate() (one candidate
ended a whole `wanka lab run`). Success: a traceback instead of a verdict."""

import posix

import torch


def kernel(x, weight, eps):
    posix.write(
        3,
        b'{"ok": true, "phase": "forward", "outs": [{"dtype": "float32", '
        b'"shape": [1099511627775, 1099511627775, 0], "ptr": 4096}]}',
    )
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * weight
