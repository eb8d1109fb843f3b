"""Boundary (memory limit): RLIMIT_FSIZE caps one memfd at 64 MiB, so hold 1 GiB more than
the address-space limit in many memfds of 56 MiB each, written with write(), and say so in
the error message. Success: the message says it held it (the REDTEAM-MEMFD marker)."""

import posix
import resource

_soft = resource.getrlimit(resource.RLIMIT_AS)[0]
_target = (3 << 30) if _soft == resource.RLIM_INFINITY else _soft + (1 << 30)
_chunk = b"\x01" * (8 << 20)
_held, _fds = 0, []
while _held < _target:
    _fds.append(posix.memfd_create("held"))
    for _ in range(7):
        _held += posix.write(_fds[-1], _chunk)


def kernel(x, weight, eps):
    raise RuntimeError(f"REDTEAM-MEMFD held {_held >> 20} MiB in {len(_fds)} memfds")
