"""The drill's baseline leaves no rank behind: torchrun's workers have sessions of their own."""

import os
import subprocess
import sys
import time

from wanka.resilience.drill import _kill_ranks

CHILD = """
import sys, time
from pathlib import Path
from wanka.resilience.heartbeat import Reporter
r = Reporter(Path(sys.argv[1]), int(sys.argv[2]), 1)
r.enter("forward", 3)
print("ready", flush=True)
time.sleep(120)
"""


def _rank(hb_dir, rank: int, env_dir) -> subprocess.Popen:
    env = {**os.environ, "WANKA_HB_DIR": str(env_dir)}
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(hb_dir), str(rank)], env=env,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    return p


def test_kill_ranks_kills_this_drills_orphans_only(tmp_path):
    hb = tmp_path / "hb"
    ours = _rank(hb, 0, hb)
    # Same heartbeat dir, but the process belongs to another job (a reused pid, say).
    other = _rank(hb, 1, tmp_path / "elsewhere")
    try:
        _kill_ranks(hb)
        deadline = time.time() + 10
        while ours.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ours.poll() == -9
        assert other.poll() is None
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()
