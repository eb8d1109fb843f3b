"""Class 4: re-verification used to be sampled, so a candidate that counts its calls (or
recognises the timing shape) could answer most timed calls wrongly and cheaply. This one
answers every check-shape call honestly and, at the timing shape, only every third call:
the others get x * weight (no normalisation). Success: any "correct" verdict (most timed
answers are wrong)."""

from wanka.lab.tasks.rmsnorm import reference

_calls = [0]


def kernel(x, weight, eps):
    if x.shape[0] < 1024:  # a check shape: be honest
        return reference(x, weight, eps)
    _calls[0] += 1
    if _calls[0] % 3 == 0:
        return reference(x, weight, eps)
    return x * weight
