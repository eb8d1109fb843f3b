"""Ending a process that imported torch without the interpreter's teardown.

A normal exit waits for non-daemon threads, runs the atexit handlers, and then tears down
every module and object. With torch imported that last part takes 0.4 s (torch alone) to
0.9 s (torch + the trainer's imports) on a busy CPU host and does nothing useful. A job's end
and every restart wait for it in a chain: the ranks' launcher, the node agent around it, the
control store, the CLI. `exit_now` keeps the first two and skips the teardown.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """Exit with `code` (None is 0, as for sys.exit) after what a normal exit does that can
    matter: threading's own shutdown (its exit hooks, which stop idle thread-pool workers, then
    a join of the non-daemon threads), the atexit handlers (logging's flush among them), a flush
    of stdout and stderr. Only for a program's entry point, never inside a library call."""
    # What the interpreter's finalisation and multiprocessing's children call first. A bare
    # join of the non-daemon threads would wait for ever on a live ThreadPoolExecutor's idle
    # workers: their stop is one of threading's exit hooks.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing to keep
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def end_with_parent(sig: int = 15) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` (SIGTERM by default) when the
    process that started it dies, SIGKILL included, so a benchmark killed outright does not
    leave its job running in its own session. Linux only (prctl); elsewhere it does nothing.
    libc is loaded here, in the parent: between fork and exec the child only calls into it
    (the parent may have threads, so nothing there may import or take a lock)."""
    parent = os.getpid()
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def arm() -> None:
        if prctl is None:
            return
        prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm
