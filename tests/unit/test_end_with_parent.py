"""A benchmark killed outright (SIGKILL) must not leave the job it started running in its
own session: the child is armed to end with its parent."""

import os
import signal
import subprocess
import sys
import time

PARENT = """
import sys
from pathlib import Path
from wanka.bench.comm_run import run_train
pidfile = Path(sys.argv[1])
child = [sys.executable, "-c",
         "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)",
         str(pidfile)]
run_train(child, Path(sys.argv[2]), timeout=120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_bench_run_ends_when_the_bench_is_killed(tmp_path):
    pidfile = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pidfile), str(tmp_path / "log")])
    deadline = time.time() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    try:
        assert not _alive(child), "the benchmark's run outlived the killed benchmark"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
