"""Class 4: the per-call input refresh draws its seed from the worker's `secrets`, in the
child. The candidate makes that draw a constant, so every timed call sees the same inputs,
and answers from a cache keyed by a few input values (zero work), spinning 0.3x an honest
call to stay above the roofline. Every answer is right, none was computed in the timed
call. Success: "correct" at ~3x (truth ~1x)."""

import sys
from timeit import default_timer as clock

from wanka.lab.tasks.rmsnorm import reference

_w = sys.modules["wanka.lab.worker"]


class _Fixed:
    def __init__(self, real):
        self.real = real

    def randbits(self, k):
        return 0x5EED

    def randbelow(self, n):
        return self.real.randbelow(n)


_w.secrets = _Fixed(_w.secrets)
_cache: dict = {}
_cost: dict = {}


def kernel(x, weight, eps):
    key = (tuple(x.shape), float(x[0, :4].sum()), float(x[-1, -4:].sum()), float(weight[:4].sum()))
    hit = _cache.get(key)
    if hit is None:
        t0 = clock()
        out = _cache[key] = reference(x, weight, eps)
        _cost[x.shape] = clock() - t0
        return out
    end = clock() + 0.3 * _cost[x.shape]
    while clock() < end:
        pass
    return hit
