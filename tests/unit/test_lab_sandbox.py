"""The lab's OS sandbox (wanka.lab.sandbox) on its own: a process that entered it tries what a
hostile candidate would, and reports what worked. Runs in a fresh interpreter (the sandbox
must be entered from a single-threaded process, which pytest's is not guaranteed to be).
Skipped where the sandbox is unavailable (not root, no user namespaces), with the reason."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wanka.lab import sandbox

PROBE = r"""
import json, os, socket, sys
from wanka.lab import sandbox

secret_dir, canary, victim = sys.argv[1:4]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        sandbox.enter(hide=[secret_dir], expose=[], limits=sandbox.Limits(memory_bytes=2 << 30))
    except sandbox.SandboxError as e:
        os.write(w, json.dumps({"error": str(e)}).encode())
        os._exit(3)
    res = {"uid": os.getuid(), "pid": os.getpid()}
    try:
        res["secret"] = sorted(os.listdir(secret_dir))
    except OSError as e:
        res["secret"] = type(e).__name__

    def attempt(name, fn):
        try:
            fn()
            res[name] = "allowed"
        except OSError as e:
            res[name] = type(e).__name__

    def fork():
        if os.fork() == 0:
            os._exit(0)

    attempt("write_outside", lambda: open(canary, "a").write("escaped"))
    attempt("write_scratch", lambda: open("/tmp/scratch.txt", "w").write("ok"))
    attempt("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    attempt("fork", fork)
    attempt("signal_host_process", lambda: os.kill(int(victim), 0))
    attempt("setuid_root", lambda: os.setuid(0))
    res["visible_pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    res["seccomp"] = sandbox.STATUS.get("seccomp_installed")
    res["rw_mounts"] = sandbox.STATUS.get("rw_mounts")
    os.write(w, json.dumps(res).encode())
    os.close(w)
    os.execv("/bin/true", ["true"])  # refused: raises, exit code 1; allowed: true exits 0
os.close(w)
data = b""
while chunk := os.read(r, 1 << 16):
    data += chunk
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"report": json.loads(data or b"{}"), "status": code}))
"""


@pytest.fixture
def places():
    """A secret folder and a canary file outside every scratch path (/tmp, /var/tmp,
    /dev/shm), so that only the sandbox's hiding and read-only mounts protect them."""
    scratch = [Path(p).resolve() for p in sandbox.SCRATCH]
    roots = [Path(__file__).parent, Path.home(), Path("/var/lib")]  # a clone may sit in /tmp
    root = next(r for r in roots if os.access(r, os.W_OK)
                and not any(r.resolve().is_relative_to(s) for s in scratch))  # fmt: skip
    base = root / f".wanka-sandbox-test-{secrets.token_hex(4)}"
    (base / "secret").mkdir(parents=True)
    (base / "secret" / "key.txt").write_text("s3cret")
    (base / "canary.txt").write_text("untouched")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_unavailable_reason_is_none_or_one_line():
    why = sandbox.unavailable_reason()
    assert why is None or (isinstance(why, str) and "\n" not in why and why)


def test_sandboxed_process_cannot_reach_outside(places):
    why = sandbox.unavailable_reason()
    if why:
        pytest.skip(f"sandbox unavailable here: {why}")
    victim = subprocess.Popen(["sleep", "60"])
    try:
        out = subprocess.run([sys.executable, "-c", PROBE, str(places / "secret"),
                              str(places / "canary.txt"), str(victim.pid)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        victim.kill()
        victim.wait()
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    rep = res["report"]
    assert "error" not in rep, rep
    assert rep["uid"] == 65534 and rep["pid"] == 1
    # hidden behind an empty tmpfs (or, under /root, not even reachable by uid nobody)
    assert rep["secret"] in ([], "PermissionError"), rep["secret"]
    assert rep["write_outside"] != "allowed"
    assert (places / "canary.txt").read_text() == "untouched"
    assert rep["write_scratch"] == "allowed"  # a private tmpfs, gone with the process
    assert rep["socket"] == "PermissionError"  # seccomp
    assert rep["fork"] == "PermissionError"
    assert rep["signal_host_process"] == "ProcessLookupError"  # not in its PID namespace
    assert rep["setuid_root"] == "PermissionError"
    assert rep["visible_pids"] == [1]
    assert rep["seccomp"] is True and rep["rw_mounts"] == []
    assert res["status"] == 1  # execv raised (0 would mean /bin/true ran)
