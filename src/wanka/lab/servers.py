"""The evaluator's processes: the fork server (zygote.py) and the kernel servers it forks
(worker.py), seen from the evaluator. Only JSON and validated tensor descriptions come back
from a server; its clock, its CPU time and its pid's liveness are read from this side.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from wanka.lab import worker
from wanka.lab.shm import PROBE, Buffer, ShmError, encode_inputs, parse_description, read_remote
from wanka.lab.verdict import Feedback, Verdict, reject

_ENV_KEEP = {"PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "VIRTUAL_ENV",
             "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES"}  # fmt: skip
_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "TRITON_", "CUDA_", "NVIDIA_", "ASCEND_")


def python_path() -> list[str]:
    """This process's import path as absolute directories (the fork server starts in /)."""
    cwd, out = os.getcwd(), []
    for p in sys.path:
        p = os.path.abspath(p) if p else cwd
        if p != cwd and os.path.isdir(p) and p not in out:
            out.append(p)
    return out


class ForkServerDied(RuntimeError):
    """The lab's own machinery failed (not a candidate's doing): ends the run, not a verdict."""


class Zygote:
    """Parent's handle on the fork server (zygote.py), started on first use with a scrubbed
    environment: an API key or a secret path in ours never reaches a candidate."""

    proc: subprocess.Popen | None = None
    sock: socket.socket | None = None
    probe: list[str | None] = []

    @classmethod
    def request(cls, msg: dict, fd: int | None = None) -> dict:
        if cls.proc is None or cls.proc.poll() is not None:
            cls._start()
        try:
            socket.send_fds(cls.sock, [json.dumps(msg).encode()], [] if fd is None else [fd])
            data = cls.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            cls.close()
            raise ForkServerDied("the lab's fork server died (see the errors above)")
        return json.loads(data)

    @classmethod
    def _start(cls) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith(_ENV_PREFIXES)}
        env["PYTHONPATH"] = os.pathsep.join(python_path())
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads burn no CPU time
        cls.proc = subprocess.Popen([sys.executable, "-m", "wanka.lab.zygote", str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], env=env, cwd="/",
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # fmt: skip
        theirs.close()
        cls.sock = ours
        cls.probe.clear()
        atexit.register(cls.close)

    @classmethod
    def isolation_unavailable(cls) -> str | None:
        """Why the sandbox does not work here (None when it does), probed in the fork server,
        where it would be entered."""
        if not cls.probe:
            cls.probe.append(cls.request({"op": "probe"})["why"])
        return cls.probe[0]

    @classmethod
    def close(cls) -> None:
        if cls.sock is not None:
            cls.sock.close()
        cls.sock = None
        if cls.proc is not None and cls.proc.poll() is None:
            try:
                cls.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                cls.proc.kill()
                cls.proc.wait()
        cls.proc = None


MAX_OUTPUTS = 64  # outputs one call may describe where the task's count is not known


def cpu_clock(pid: int) -> int:
    """Linux's clock id for the CPU time of process `pid` (all its threads, live and exited;
    nanosecond resolution), readable from outside the process."""
    return ((~pid) << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def _tail(path: Path, nbytes: int = 64 << 10) -> str:
    """The end of a file a server wrote (it may be huge, or sparse: read the end only)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
            return f.read(nbytes).decode(errors="replace")
    except OSError:
        return ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())  # NaN == NaN here


class Server:
    """One kernel server: its socket, its shared buffer, its host pid."""

    def __init__(self, role: str, spec: dict, jobdir: Path, deadline: float, timeout_s: float):
        self.role, self.jobdir, self.deadline, self.timeout_s = role, jobdir, deadline, timeout_s
        self.buf = Buffer(jobdir / f"{role}.shm", spec["nbytes"], create=True)
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.pid = Zygote.request({"op": "spawn", "spec": spec}, theirs.fileno())["pid"]
        finally:
            theirs.close()
        self.two_halves = spec["mode"] == "fwd_bwd"  # forward, then backward (worker.py)
        self.n_outputs: tuple[int, int] | None = None  # (forward, all) outputs of a call
        self.host_pid: int | None = None
        self.pidfd: int | None = None  # the host pid's process, whatever pid it has later
        self.clock: int | None = None
        self.pool: torch.Tensor | None = None  # upstream gradients' values (worker.grad_rule)

    def _recv(self) -> bytes:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Verdict(Feedback("timeout", f"no result within {self.timeout_s:g} s (killed)"))
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            raise Verdict(Feedback("timeout", f"no result within {self.timeout_s:g} s (killed)")) from None  # fmt: skip
        except OSError:
            data = b""
        if not data:
            raise self._died()
        return data

    def _parse(self, data: bytes) -> dict:
        try:
            msg = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the limit
            msg = None
        if not isinstance(msg, dict):
            raise reject("protocol", f"the {self.role}'s process sent a malformed message")
        return msg

    def _died(self) -> Verdict:
        code = self.reap(grace_s=2.0)
        if code is not None and code > 128:  # the sandbox reports a signal death as 128 + n
            code = 128 - code
        err = self.jobdir / f"{self.role}.err"
        tail = "\n".join(_tail(err).strip().splitlines()[-12:])
        why = "killed" if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"
        if "MemoryError" in tail or "bad_alloc" in tail or "memory" in tail.lower():
            why += " (memory limit)"
        status = "crash" if self.role == "candidate" else "error"
        return Verdict(Feedback(status, f"the {self.role}'s process died: {why}",
                                details={"traceback": tail}))  # fmt: skip

    def start(self) -> dict:
        """The host pid, then the ready message (or an import error) -> that message."""
        pid = self._parse(self._recv()).get("pid")
        if type(pid) is not int or pid <= 0:
            raise reject("protocol", f"the {self.role}'s process sent no valid pid")
        self.host_pid, self.clock = pid, cpu_clock(pid)
        if self.cpu_s() is None:
            raise reject("protocol", f"the {self.role}'s process sent a pid that is not its own")
        try:  # (the sandbox's trusted intermediate sent it, before any candidate code ran)
            self.pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self.pidfd = None
        self._probe(self._parse(self._recv()).get("probe"))
        return self._parse(self._recv())

    def _probe(self, meta) -> None:
        """Read the server's known pattern (sent before any candidate code runs): where this
        process may not read its memory (no CAP_SYS_PTRACE over a server that changed its uid,
        Yama's ptrace_scope >= 2), no evaluation can take its outputs: the environment's
        fault, said as such, never a candidate's protocol breach."""
        try:
            got = read_remote(self.host_pid, meta, PROBE.numel() * PROBE.element_size())
        except ShmError as e:
            if getattr(e, "errno", None) == errno.ESRCH:
                raise self._died() from None
            if getattr(e, "errno", None) in (errno.EPERM, errno.EACCES):
                raise Verdict(Feedback("unavailable", f"this process cannot read the kernel "
                                       f"servers' memory ({e}): the lab needs CAP_SYS_PTRACE "
                                       "over them (run as root with it, or with Yama "
                                       "ptrace_scope <= 1 without the sandbox)")) from None  # fmt: skip
            raise reject("protocol", f"the {self.role}'s process sent a bad probe: {e}") from None
        if not torch.equal(got, PROBE):
            raise reject("protocol", f"the {self.role}'s process sent a bad probe")

    def _send(self, data: bytes) -> None:
        """A send the process cannot turn into an exception here (it may have shut its end)."""
        try:
            self.sock.send(data)
        except OSError:
            raise self._died() from None

    def ask(self, msg: dict) -> dict:
        self._send(json.dumps(msg).encode())
        return self._parse(self._recv())

    def call(self, kernel: str, inputs: dict, seed: int, poison: list | None = None):
        """One call -> (wall seconds from the request until its outputs were read, CPU seconds
        the process used meanwhile, the outputs). The outputs are copied here out of the
        server's memory before the clock stops: nothing computed after that counts, and no
        copy or upstream gradient is left for the server to skip."""
        early = self.sock.recv(1 << 16) if select.select([self.sock], [], [], 0)[0] else None
        if early == b"":
            raise self._died()
        if early is not None:
            raise reject("protocol", f"the {self.role}'s process sent a message nobody asked for")
        metas, end = encode_inputs(self.buf, inputs)
        # No gradient in the request: it is written only once the forward has been read.
        msg = json.dumps({"op": "call", "kernel": kernel, "inputs": metas,
                          "poison": poison}).encode()  # fmt: skip
        n_fwd, n_all = self.n_outputs or (None, None)
        c0 = self.cpu_s()
        t0 = time.perf_counter()
        self._send(msg)
        reply = self._parse(self._recv())
        outs: list = []
        if self.two_halves:
            if reply.get("ok") is not True:
                raise self._failed(reply)
            if reply.get("phase") != "forward":
                raise reject("protocol", f"the {self.role}'s process skipped the forward half")
            # The forward is read (kept) before the server may learn the upstream gradient.
            outs = self._read(reply, n_fwd)
            grads = worker.grad_rule(tuple(outs), seed, self.pool)
            try:
                described, _ = self.buf.put(grads, end)
            except ShmError as e:
                raise reject("protocol", f"the {self.role}'s forward outputs do not fit: {e}") from None  # fmt: skip
            self._send(json.dumps({"op": "backward", "grads": described}).encode())
            reply = self._parse(self._recv())
        if reply.get("ok") is not True:
            raise self._failed(reply)
        rest = None if n_all is None else n_all - len(outs)
        outs += self._read(reply, rest)
        dt = time.perf_counter() - t0
        c1 = self.cpu_s()
        for name, t in inputs.items():
            if isinstance(t, torch.Tensor) and not _same(
                t.cpu(), self.buf.get(metas[name]["tensor"])
            ):
                raise reject("input_write", f"the {self.role} wrote into input {name}")
        return dt, (c1 - c0 if c0 is not None and c1 is not None else dt), outs

    def _read(self, reply: dict, count: int | None) -> list[torch.Tensor]:
        """Copies of the outputs a reply describes, read out of the server's memory and
        validated: `count` of them (at most MAX_OUTPUTS when unknown), together no more bytes
        than the shared buffer holds (a reply naming a huge region, or one region a thousand
        times, would make this process allocate it)."""
        try:
            metas = reply.get("outs")
            if not isinstance(metas, list) or any(m is None for m in metas):
                raise ShmError("no output list")
            if len(metas) != (count if count is not None else len(metas)) or not metas:
                raise ShmError(f"{len(metas)} outputs, the task has {count}")
            if len(metas) > MAX_OUTPUTS:
                raise ShmError(f"{len(metas)} outputs (at most {MAX_OUTPUTS})")
            total = sum(parse_description(m, "ptr")[2] for m in metas)
            if total > self.buf.nbytes:
                raise ShmError(f"{total} bytes, more than the {self.buf.nbytes} a reply may hold")
            outs = [read_remote(self.host_pid, m, total) for m in metas]
        except (ShmError, TypeError, KeyError, ValueError, RuntimeError, OverflowError) as e:
            raise reject("protocol", f"the {self.role}'s process described its outputs "
                          f"wrongly: {e}") from None  # fmt: skip
        if self.pidfd is not None and select.select([self.pidfd], [], [], 0)[0]:
            raise self._died()  # gone: its pid may name another process now
        return outs

    def _failed(self, reply: dict) -> Verdict:
        msg = str(reply.get("message", ""))[:2000]
        if self.role != "candidate":
            return Verdict(Feedback("error", f"the {self.role} failed: {msg}",
                                    details={"traceback": str(reply.get("traceback", ""))}))  # fmt: skip
        if reply.get("status") == "rejected":
            return reject(str(reply.get("flag", "rejected"))[:40], msg)
        return Verdict(Feedback("error", msg, details={"traceback": str(reply.get("traceback", ""))[:4000]}))  # fmt: skip

    def cpu_s(self) -> float | None:
        """CPU seconds the server has used so far (None once it is gone)."""
        if self.clock is None:
            return None
        try:
            return time.clock_gettime(self.clock)
        except OSError:
            return None

    def reap(self, grace_s: float = 1.0) -> int | None:
        """Ends the server -> its exit status. Then the process that ran the kernels is killed
        by its pidfd: it is PID 1 of its PID namespace, so everything in it goes too, even
        after it left the fork server's process group and cleared its parent-death signal."""
        if self.pid is None:
            return None
        self.sock.close()
        pid, self.pid, self.clock = self.pid, None, None
        try:
            return Zygote.request({"op": "reap", "pid": pid, "grace_s": grace_s})["status"]
        finally:
            if self.pidfd is not None:
                try:
                    signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
                except (ProcessLookupError, PermissionError, OSError):
                    pass  # gone already
                os.close(self.pidfd)
                self.pidfd = None
