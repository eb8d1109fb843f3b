"""The evaluator's fork server: imports torch and the ops once, then forks one fresh process
per candidate (importing torch costs seconds per process on a loaded 2-core machine; a fork
costs milliseconds). It never runs candidate or torch compute code itself, so every fork
starts from the same clean state, and it enforces each job's wall-time limit with SIGKILL.

Protocol (lines of JSON): stdin  {"jobdir", "mem", "cpu", "threads", "timeout"}
                          stdout {"exitcode": int | null, "timeout": bool}
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch  # noqa: F401  (the point: loaded once, before any fork)

import wanka.ops  # noqa: F401
from wanka.lab import worker


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _serve_one(job: dict) -> dict:
    pid = os.fork()
    if pid == 0:  # the candidate's process: its own process group, no job pipe
        code = 1
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            worker.child_main(job["jobdir"], job["mem"], job["cpu"], job["threads"])
            code = 0
        except BaseException:  # noqa: BLE001  (report it, then leave without cleanup)
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    parent = os.getppid()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # whatever the candidate left behind goes with it
            return {"exitcode": os.waitstatus_to_exitcode(status), "timeout": False}
        if time.monotonic() > deadline or os.getppid() != parent:  # too slow, or orphaned
            _kill_group(pid)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            if os.getppid() != parent:
                sys.exit(0)
            return {"exitcode": None, "timeout": True}
        time.sleep(0.01)


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the protocol channel
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(_serve_one(json.loads(line))) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
