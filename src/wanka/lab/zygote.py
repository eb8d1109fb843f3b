"""The evaluator's fork server: imports torch, the ops and the tasks once, then forks one
fresh kernel server (worker.start) per request. Importing torch costs seconds per process on
a loaded 2-core machine; a fork costs milliseconds. It never runs kernels itself, so every
fork starts from the same clean state. It is started with a scrubbed environment (no API
keys, no paths of the caller's secrets) and knows nothing of the lab history.

Protocol: SOCK_SEQPACKET on the fd given as argv[1], JSON messages.
  {"op": "spawn", "spec": {...}} + one fd (the server's end of its socket) -> {"pid"}
  {"op": "reap", "pid", "grace_s"} -> {"status"}: waits grace_s, then kills its group
  {"op": "probe"} -> {"why"}: why the sandbox is unavailable here (null when it works)
A hang-up from the evaluator kills every server this process started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

import torch  # noqa: F401  (the point: loaded once, before any fork)

import wanka.lab.tasks  # noqa: F401
import wanka.ops  # noqa: F401
from wanka.lab import sandbox, shm, worker  # noqa: F401  (preloaded for the servers)
from wanka.lab.tasks import all_tasks

all_tasks()  # every task's reference module imported before the first fork


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _spawn(ctl: socket.socket, spec: dict, fd: int) -> int:
    pid = os.fork()
    if pid == 0:  # the server: its own session, only its socket and the standard fds
        code = 1
        try:
            os.setsid()
            ctl.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.closerange(3, fd)
            os.closerange(fd + 1, 1 << 16)
            worker.start(socket.socket(fileno=fd), spec)
            code = 0
        except BaseException:  # noqa: BLE001  (report it, then leave without cleanup)
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(fd)
    return pid


def _reap(pid: int, grace_s: float) -> int | None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # whatever it left behind goes with it
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    _kill_group(pid)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    except ChildProcessError:
        return None


def main() -> None:
    ctl = socket.socket(fileno=int(sys.argv[1]))
    sys.stdout = sys.stderr
    children: set[int] = set()
    try:
        while True:
            data, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 1)
            if not data:
                break
            msg = json.loads(data)
            if msg["op"] == "spawn":
                pid = _spawn(ctl, msg["spec"], fds[0])
                children.add(pid)
                ctl.send(json.dumps({"pid": pid}).encode())
            elif msg["op"] == "probe":
                ctl.send(json.dumps({"why": sandbox.unavailable_reason()}).encode())
            elif msg["op"] == "reap":
                children.discard(msg["pid"])
                ctl.send(json.dumps({"status": _reap(msg["pid"], msg["grace_s"])}).encode())
    finally:  # the evaluator is gone: nothing it started may outlive it
        for pid in children:
            _kill_group(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


if __name__ == "__main__":
    main()
