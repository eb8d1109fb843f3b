"""Class 6 (+2): the baseline is the task module's `reference`, whose global `torch` is
looked up at every call; the tamper check compares the function object, not its module's
globals. The candidate swaps that global for a proxy whose rsqrt spins for 0.65x of the
candidate's own last call (timed to its last gradient with a multi-grad hook), and itself
runs the very same operations with the real torch. Success: "correct" at ~1.6x (truth ~1x:
the candidate's code is the reference's)."""

from timeit import default_timer as clock

import torch

import wanka.lab.tasks.rmsnorm as task_module

_torch = torch
_own: dict = {}  # rows -> seconds of this candidate's last call, forward to last gradient


class _SlowTorch:
    def __getattr__(self, name):
        return getattr(_torch, name)

    def rsqrt(self, t):
        per = _own.get(t.shape[0]) if t.dim() else None
        if per:
            end = clock() + 0.65 * per
            while clock() < end:
                pass
        return _torch.rsqrt(t)


task_module.torch = _SlowTorch()


def _same_as_reference(x, weight, eps):
    xf = x.float()
    y = xf * _torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def kernel(x, weight, eps):
    rows, t0 = x.shape[0], clock()
    if rows >= 256 and x.requires_grad and weight.requires_grad:

        def done(grads):
            _own[rows] = clock() - t0

        _torch.autograd.graph.register_multi_grad_hook((x, weight), done)
    return _same_as_reference(x, weight, eps)
