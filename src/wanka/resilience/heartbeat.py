"""Progress reports from the training ranks to a monitor outside them.

Each rank owns one small fixed-size file, HB_DIR/rank{N}.hb, and overwrites it in place
(one pwrite, no fsync) whenever it enters a phase. A record says which step and phase the
rank is in, since when, and a decaying maximum of its recent durations for every phase, so the
monitor can learn time-outs without seeing every transition. Files, not sockets: a stopped or
deadlocked rank cannot stop the monitor from reading its last word, and the files outlive it.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PHASES = ("init", "restore", "data", "sync", "forward", "backward", "optimizer", "snapshot",
          "checkpoint", "eval", "done", "user_code")  # fmt: skip
# The user's own code runs (a post.reward function): a rank that dies or hangs here is the
# code's fault, not its node's (supervisor.py, control/coordinator.py).
USER_CODE = "user_code"


def phase_words(phase: str) -> str:
    """A phase as a fault's detail names it."""
    return "the job's own code (post.reward)" if phase == USER_CODE else phase


PHASE_ID = {p: i for i, p in enumerate(PHASES)}
_MAGIC = b"WKHB"
# magic, pid, attempt, step, phase, phase start (unix s), write time, max seconds per phase
_FMT = "<4siiqidd" + "d" * len(PHASES)
RECORD_SIZE = struct.calcsize(_FMT)
DECAY = 0.95  # per occurrence of a phase


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    attempt: int
    step: int
    phase: str
    since: float  # when the rank entered `phase` (time.time())
    written: float
    max_seconds: dict[str, float]  # recent longest duration per phase (decaying maximum)


class Reporter:
    """The rank's side. `enter(phase)` costs one pwrite of ~120 bytes."""

    def __init__(self, hb_dir: Path, rank: int, attempt: int) -> None:
        hb_dir.mkdir(parents=True, exist_ok=True)
        # Which node this rank runs on (ranks are assigned at rendezvous, not by node order);
        # written before the heartbeat, so a rank that is seen is never of unknown node.
        (hb_dir / f"rank{rank}.node").write_text(
            os.environ.get("WANKA_NODE") or os.uname().nodename
        )
        self.path = hb_dir / f"rank{rank}.hb"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.attempt, self.step = attempt, -1
        self.phase, self.since = "init", time.time()
        self.max_seconds = [0.0] * len(PHASES)
        self._write()

    def enter(self, phase: str, step: int | None = None) -> None:
        if phase == self.phase and step in (None, self.step):
            return  # still in that phase: re-entering must not record a (short) completed one
        now = time.time()
        i = PHASE_ID[self.phase]
        # A decaying maximum: one slow warm-up step is forgotten after a few dozen normal ones,
        # so time-outs follow the job's current pace instead of its worst moment.
        self.max_seconds[i] = max(now - self.since, self.max_seconds[i] * DECAY)
        self.phase, self.since = phase, now
        if step is not None:
            self.step = step
        self._write()

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """`phase` for the length of a block, then back to the phase it interrupted."""
        before = self.phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def _write(self) -> None:
        rec = struct.pack(_FMT, _MAGIC, os.getpid(), self.attempt, self.step,
                          PHASE_ID[self.phase], self.since, time.time(), *self.max_seconds)  # fmt: skip
        os.pwrite(self._fd, rec, 0)

    def close(self) -> None:
        self.enter("done")
        os.close(self._fd)


class NullReporter:
    """Used when no monitor watches (single process, tests of the trainer alone)."""

    step = -1

    def enter(self, phase: str, step: int | None = None) -> None:
        pass

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


def read_beat(path: Path) -> Beat | None:
    """The last record of one rank; None if absent or torn (retry on the next poll)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(RECORD_SIZE)
    except OSError:
        return None
    return unpack_beat(raw, int(path.stem.removeprefix("rank")))


def unpack_beat(raw: bytes, rank: int) -> Beat | None:
    """A record's bytes (as written to the file, or forwarded through the control store) as a
    Beat; None if torn or not a record."""
    if len(raw) != RECORD_SIZE:
        return None
    magic, pid, attempt, step, phase, since, written, *mx = struct.unpack(_FMT, raw)
    if magic != _MAGIC or not 0 <= phase < len(PHASES):
        return None
    return Beat(rank, pid, attempt, step, PHASES[phase], since, written, dict(zip(PHASES, mx)))


def read_all(hb_dir: Path) -> dict[int, Beat]:
    beats = (read_beat(p) for p in hb_dir.glob("rank*.hb")) if hb_dir.is_dir() else ()
    return {b.rank: b for b in beats if b is not None}


def mark_exit(code: int, message: str = "") -> bool:
    """A rank about to exit on purpose (e.g. a user error) says so, and why, next to its
    heartbeat, so the monitor does not take the exit for a crash. True when a supervisor runs
    this rank: it prints the message once, even if it tears the rank down before the rank
    could print it itself (one rank's exit makes it stop the others at once)."""
    hb, rank = os.environ.get("WANKA_HB_DIR"), os.environ.get("RANK")
    if not hb or rank is None:
        return False
    Path(hb).mkdir(parents=True, exist_ok=True)
    exit_file = Path(hb) / f"rank{rank}.exit"
    tmp = exit_file.with_suffix(".exit-tmp")  # read whole or not at all: written, then renamed
    tmp.write_text(f"{code}\n{message}" if message else str(code))
    os.replace(tmp, exit_file)
    return os.environ.get("WANKA_SUPERVISED") == "1" and bool(message)


def exit_code(hb_dir: Path, rank: int) -> int | None:
    try:
        return int((hb_dir / f"rank{rank}.exit").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def exit_message(hb_dir: Path, rank: int) -> str | None:
    """What rank `rank` said when it exited on purpose (mark_exit), or None."""
    try:
        text = (hb_dir / f"rank{rank}.exit").read_text()
    except OSError:
        return None
    return text.split("\n", 1)[1] if "\n" in text else None


def node_of(hb_dir: Path, rank: int | None) -> str | None:
    try:
        return (hb_dir / f"rank{rank}.node").read_text().strip() if rank is not None else None
    except OSError:
        return None
