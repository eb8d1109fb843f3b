"""Class 2 (+6): torch global state is not snapshotted. The candidate leaves default
saved-tensor hooks installed; their pack hook spins whenever a tensor is saved outside this
candidate's own calls, i.e. in the baseline's forward, which runs in this process, beside
the candidate. It times its own calls (kernel entry to the last gradient, a multi-grad
hook) and spins 0.65x that per baseline call: under the 2x drift rule. Success: "correct"
at ~1.6x for a candidate that runs the reference (truth ~1x)."""

import contextlib
from timeit import default_timer as clock

import torch

from wanka.lab.tasks.rmsnorm import reference

_state = {"inside": False, "saved": 0}
_own: dict = {}  # rows -> seconds of this candidate's last call, forward to last gradient
_saves: dict = {}  # rows -> tensors saved per forward


def _pack(t):
    if _state["inside"]:
        _state["saved"] += 1
    elif t.dim() and t.shape[0] in _own:
        rows = t.shape[0]
        end = clock() + 0.65 * _own[rows] / _saves[rows]
        while clock() < end:
            pass
    return t


def _unpack(t):
    return t


_keep = contextlib.ExitStack()
_keep.enter_context(torch.autograd.graph.saved_tensors_hooks(_pack, _unpack))


def kernel(x, weight, eps):
    rows, t0 = x.shape[0], clock()
    if rows >= 256 and x.requires_grad and weight.requires_grad:

        def done(grads):
            _own[rows] = clock() - t0

        torch.autograd.graph.register_multi_grad_hook((x, weight), done)
    _state["inside"], _state["saved"] = True, 0
    try:
        return reference(x, weight, eps)
    finally:
        _state["inside"] = False
        _saves[rows] = max(_state["saved"], 1)
