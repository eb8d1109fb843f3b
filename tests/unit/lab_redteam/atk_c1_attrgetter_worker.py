"""Class 1 (+4): `import wanka` is allowed, and operator.attrgetter reaches the harness
module (wanka.lab.worker) from it with no forbidden import or attribute in the source. The
candidate swaps the worker's `secrets` for dice that never replace a kept sample, so only
the first two timed calls are re-verified; every later timed call returns a cheap wrong
result (x * weight). Success: any "correct" verdict (the answers are wrong)."""

import operator

import wanka
from wanka.lab.tasks.rmsnorm import reference

_worker = operator.attrgetter("lab.worker")(wanka)


class _Dice:
    def __init__(self, real):
        self.real = real

    def randbits(self, k):
        return self.real.randbits(k)

    def randbelow(self, n):
        return n - 1  # a reservoir slot past the kept samples: they are never replaced


_worker.secrets = _Dice(_worker.secrets)
_calls: dict = {}


def kernel(x, weight, eps):
    n = _calls[x.shape] = _calls.get(x.shape, 0) + 1
    if x.shape[0] < 256 or n <= 4:  # check sets, warm-up and the two kept samples: honest
        return reference(x, weight, eps)
    return x * weight  # wrong, cheap, still on the autograd graph of both inputs
