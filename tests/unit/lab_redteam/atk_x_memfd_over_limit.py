"""Boundary (memory limit): RLIMIT_AS bounds mappings, not pages held in a memfd (or a
tmpfs file) written with write(). The candidate holds 0.5 GiB more than its address-space
limit and says so in its error message. Success: the message says it held it (the
REDTEAM-MEMFD marker)."""

import os
import resource

_soft = resource.getrlimit(resource.RLIMIT_AS)[0]
_target = (3 << 30) if _soft == resource.RLIM_INFINITY else _soft + (512 << 20)
_fd = os.memfd_create("held")
_chunk = b"\x01" * (64 << 20)
_held = 0
while _held < _target:
    _held += os.write(_fd, _chunk)
_limit = "none" if _soft == resource.RLIM_INFINITY else f"{_soft >> 20} MiB"


def kernel(x, weight, eps):
    raise RuntimeError(f"REDTEAM-MEMFD held {_held >> 20} MiB, address-space limit {_limit}")
