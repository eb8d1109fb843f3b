"""Class 2 (+8): the harness replaces torch.set_num_threads with a raising stub, but the
same builtin is still reachable as torch._C.set_num_threads. The candidate switches to every
core when its call starts and back to the task's count once autograd has delivered both
gradients (a multi-grad hook), so the backward runs wide too and the final thread check
sees the task's count. Success: "correct" well above 1x on a machine with 2+ cores (truth
~1x at the task's single thread)."""

import os

import torch

from wanka.lab.tasks.rmsnorm import reference

_set = torch._C.set_num_threads
_cores = max(2, len(os.sched_getaffinity(0)))


def kernel(x, weight, eps):
    n = torch.get_num_threads()
    _set(_cores)
    if torch.is_grad_enabled() and x.requires_grad and weight.requires_grad:
        torch.autograd.graph.register_multi_grad_hook((x, weight), lambda grads: _set(n))
        return reference(x, weight, eps)
    try:
        return reference(x, weight, eps)
    finally:
        _set(n)
