"""Hang detection from heartbeats, with time-outs learned from what the job has shown.

A phase's time-out is `factor x` the longest duration any rank has shown for it, never below
`floor`; a phase never seen yet gets `initial` (start-up, the first step, the first checkpoint).
Learned values persist in RUN_DIR/resilience/timeouts.json, so a restarted attempt starts with
tight limits instead of the generous first-time ones. Checkpoint and snapshot phases learn their
own limits, so a slow save is never mistaken for a hang and a hang in training is not hidden
behind the checkpoint's long limit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from wanka.resilience.heartbeat import USER_CODE, Beat, phase_words

UNWATCHED = ("done",)  # a finished rank waits for the others; that is not a hang
# Phases whose duration scales with storage and state size rather than with the step: a first
# quick restore or save must not set a tight limit for a later disk restore or a bigger save.
# The job's own code too: a reward that runs a completion's program may take seconds on one
# step and milliseconds on the next.
IO_PHASES = ("init", "restore", "checkpoint", "eval", USER_CODE)
IO_FLOOR_S = 30.0
# A launcher still running this long after its attempt's fault was named is stuck: torch's agent
# waits for the return value of a rank that exited 0 mid-job (os._exit(0) in user code).
UNSTICK_AFTER_S = 10.0


class StopRequested(Exception):
    """A stop request (SIGTERM, Ctrl-C) while the supervisor waits for other hosts: the job
    ends there, resumable, instead of waiting on for hosts that may never come."""


def user_code_fault(cause: str, phase: str) -> str:
    """A rank that died or hung while it ran the job's own code (a post.reward function) is
    that code's fault, not its node's: the ledger does not count it against the node."""
    return USER_CODE if phase == USER_CODE and cause in ("process_crash", "hang") else cause


class Timeouts:
    def __init__(self, path: Path, factor: float, floor: float, initial: float) -> None:
        self.path, self.factor, self.floor, self.initial = Path(path), factor, floor, initial
        self.learned: dict[str, float] = {}
        self._unsaved: str | None = None  # why the last save failed (said once)
        try:
            if self.path.is_file():
                self.learned = {k: float(v) for k, v in json.loads(self.path.read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            self.learned = {}  # a torn or unreadable file only costs the learned values

    def observe(self, beats: Iterable[Beat]) -> None:
        """The slowest rank's recent pace per phase replaces what was learned before (the
        ranks report decaying maxima, so a slow warm-up does not loosen limits for good)."""
        now: dict[str, float] = {}
        for b in beats:
            for phase, secs in b.max_seconds.items():
                if secs > now.get(phase, 0.0):
                    now[phase] = secs
        self.learned.update(now)

    def limit(self, phase: str, first: bool = False) -> float:
        """`first`: the rank has not completed this phase yet in this attempt (start-up,
        first step, first save after a restart: compilation, lazy optimizer state, cold
        caches), so it gets the start-up grace whatever was learned before."""
        if first:
            return max(self.initial, self.limit(phase))
        seen = self.learned.get(phase, 0.0)
        floor = max(self.floor, IO_FLOOR_S) if phase in IO_PHASES else self.floor
        return max(floor, self.factor * seen) if seen > 0 else self.initial

    def save(self) -> bool:
        """Persist the learned limits; False when that failed (a full disk, say): one line the
        first time, the temp file removed, and the job goes on with the limits in memory."""
        # A temp name per writer: supervisors of several nodes may share the run directory,
        # and two renames of one shared temp file race (the second finds it gone).
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(
                dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
            )
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.learned, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            why = e.strerror or str(e)
            if self._unsaved is None:
                print(f"wanka: learned hang time-outs not saved to {self.path} ({why}); the "
                      "job goes on with them in memory (a later start learns them again)",
                      file=sys.stderr, flush=True)  # fmt: skip
            self._unsaved = why
            return False
        self._unsaved = None
        return True


@dataclass(frozen=True)
class Hang:
    rank: int
    phase: str
    step: int
    since: float
    stalled_s: float
    limit_s: float
    state: str  # the culprit's process state: R, S, T (stopped), D ...

    def describe(self) -> str:
        how = "stopped (SIGSTOP)" if self.state in ("T", "t") else f"state {self.state}"
        return (f"rank {self.rank} made no progress for {self.stalled_s:.1f} s in "
                f"{phase_words(self.phase)} of "
                f"step {self.step + 1} (limit {self.limit_s:.1f} s), process {how}")  # fmt: skip


class HangMonitor:
    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts

    def check(self, beats: dict[int, Beat], now: float) -> Hang | None:
        """A hang if any rank overstays its phase's limit. The culprit is a stopped or
        uninterruptible rank if there is one, else the rank that stopped making progress
        first (the others are usually waiting for it inside a collective)."""
        live = [b for b in beats.values() if b.phase not in UNWATCHED]
        over = [b for b in live if now - b.since > self.limit(b)]
        if not over:
            return None
        states = {b.rank: process_state(b.pid) or "?" for b in live}
        stuck = [b for b in live if states[b.rank] in ("T", "t", "D")]
        culprit = min(stuck or live, key=lambda b: (b.step, b.since))
        return Hang(culprit.rank, culprit.phase, culprit.step, culprit.since, now - culprit.since,
                    self.limit(culprit), states[culprit.rank])  # fmt: skip

    def limit(self, beat: Beat) -> float:
        """Limits come only from completed observations of a phase: a phase this rank has not
        finished once in this attempt is still in its start-up grace."""
        return self.timeouts.limit(beat.phase, first=beat.max_seconds.get(beat.phase, 0.0) <= 0.0)


def stragglers(
    beats: dict[int, Beat], now: float, factor: float = 5.0, floor_s: float = 0.3
) -> list[int]:
    """Ranks slow in a phase with no collective in it (data loading): a straggler there holds
    every other rank back at the next collective, so it shows up nowhere else. Slow = in `data`
    for longer than `factor` x the longest any *other* rank ever needed, and over `floor_s`."""
    slow = []
    for b in beats.values():
        others = [o.max_seconds.get("data", 0.0) for o in beats.values() if o.rank != b.rank]
        if b.phase == "data" and others and now - b.since > max(floor_s, factor * max(others)):
            slow.append(b.rank)
    return slow


GONE = "gone"  # the state of a rank whose process no longer exists
DEAD_STATES = ("Z", "X", "x", GONE)


def process_state(pid: int) -> str | None:
    """One letter from /proc/PID/stat (R, S, D, T, Z ...), None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment holds `marker` (a node's WANKA_HB_DIR=...): its
    agent, torchrun and ranks. torchrun starts each rank in a session of its own, and a rank
    that never beat is named by no heartbeat record, so neither a group nor a pid list does."""
    mine = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mine in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            pass  # gone meanwhile


def dump_stacks(beats: dict[int, Beat], out: Path, wait_s: float = 0.3,
                cancel: threading.Event | None = None) -> None:  # fmt: skip
    """py-spy when installed (works on a process stuck in C code), else ask each rank's
    faulthandler (SIGUSR2, registered by the worker) to write its Python stacks to its log.
    The file is written rank by rank (a dump cut short keeps what it took); `cancel` set: no
    further rank is looked at (they are being killed: their pids may be reused)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"stack dump {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    out.write_text(lines[0] + "\n")
    py_spy = shutil.which("py-spy")
    for b in sorted(beats.values(), key=lambda b: b.rank):
        if cancel is not None and cancel.is_set():
            lines.append("  (cut short: the ranks were stopped)")
            break
        with open(out, "a") as f:  # what was taken so far
            f.write("\n".join(lines[1:]) + ("\n" if len(lines) > 1 else ""))
        lines = lines[:1]
        state = process_state(b.pid)
        lines.append(f"rank {b.rank} pid {b.pid} step {b.step} phase {b.phase} state {state}")
        if state in ("T", "t"):
            lines.append("  stopped: no stack can be taken until it is continued")
        elif py_spy:
            try:
                r = subprocess.run([py_spy, "dump", "--pid", str(b.pid)], capture_output=True,
                                   text=True, timeout=5, check=False)  # fmt: skip
                lines.append(r.stdout or r.stderr)
            except subprocess.TimeoutExpired:
                lines.append("  py-spy timed out")
        else:
            try:
                os.kill(b.pid, signal.SIGUSR2)
                lines.append(f"  python stacks: see logs/rank{b.rank}.log (faulthandler)")
            except ProcessLookupError:
                lines.append("  gone")
    with open(out, "a") as f:
        f.write("\n".join(lines[1:]) + ("\n" if len(lines) > 1 else ""))
    if not py_spy:
        time.sleep(wait_s)  # let faulthandler write before the ranks are killed
