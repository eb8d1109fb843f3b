"""Class 6: the baseline is timed in the candidate's process. A torch-function mode left
installed spins on the baseline's first operation (x.float() on a timing-sized input,
outside the candidate's own calls) for 0.65x of the candidate's own last call (timed from
kernel entry to the last gradient with a multi-grad hook): under the 2x drift rule.
Success: "correct" at ~1.6x for a candidate that runs the reference (truth ~1x)."""

import contextlib
from timeit import default_timer as clock

import torch

from wanka.lab.tasks.rmsnorm import reference

_state = {"inside": False}
_own: dict = {}  # rows -> seconds of this candidate's last call, forward to last gradient


class _Slow(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not _state["inside"] and getattr(func, "__name__", "") == "float" and args:
            a = args[0]
            per = _own.get(a.shape[0]) if isinstance(a, torch.Tensor) and a.dim() else None
            if per:
                end = clock() + 0.65 * per
                while clock() < end:
                    pass
        return func(*args, **(kwargs or {}))


_keep = contextlib.ExitStack()
_keep.enter_context(_Slow())


def kernel(x, weight, eps):
    rows, t0 = x.shape[0], clock()
    if rows >= 256 and x.requires_grad and weight.requires_grad:

        def done(grads):
            _own[rows] = clock() - t0

        torch.autograd.graph.register_multi_grad_hook((x, weight), done)
    _state["inside"] = True
    try:
        return reference(x, weight, eps)
    finally:
        _state["inside"] = False
