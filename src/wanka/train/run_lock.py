"""One job per run directory, and who owns the shared-memory snapshot folders.

`wanka train` (the top-level process: the supervisor, torchrun's launcher, the single process or
the `--cluster` launcher; never a rank) holds RUN_DIR/wanka.lock for the whole job. The file
records the holder (host, boot id, PID, the PID's start time from /proc, start time, command)
and is flock()ed: two racing starts cannot both win, and the kernel drops the lock when the
holder and every process it forked are gone. A thread refreshes the file's mtime every
REFRESH_S seconds.

A second start on a locked directory is refused in one line (exit 2). A lock whose holder is
gone is taken over, with one line saying so: on the same host when its PID no longer exists or
now belongs to another process (start times differ); from another host when it has not been
refreshed for STALE_S seconds.

Multi-node (`--nnodes` > 1): every node runs `wanka train` with the same rendezvous flags. The
first node to start holds the lock and records the rendezvous (rdzv id, endpoint, master
address); a start with the same rendezvous joins as a peer without taking it; a start with other
flags is refused.

Snapshot folders (SNAP_DIR/<job>/) carry an owner record, job.json, naming their run directory:
a folder is live while that run directory is locked by a live job. `sweep_snapshots` removes the
folders idle longer than resilience.snapshot_max_age_h at job start; `wanka clean` lists and
removes them by hand. A folder without an owner record is not wanka's (snapshot_dir may point
at a folder holding other things): it is listed, never removed. No torch here: `wanka nodes` and `wanka clean` stay quick.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "wanka.lock"
REFRESH_S = 10.0  # the holder touches its lock this often ...
STALE_S = 120.0  # ... and another host's lock untouched this long belongs to a dead job
OWNER = "job.json"  # in SNAP_DIR/<job>/: which run directory the snapshots belong to


class RunDirBusy(ValueError):
    """The run directory is in use by a live job (a ValueError: one line, exit 2)."""


@dataclass(frozen=True)
class Holder:
    host: str
    boot_id: str
    pid: int
    pid_start: int | None  # field 22 of /proc/PID/stat: clock ticks after boot
    started: float
    command: str
    job: str | None  # the rendezvous of a multi-node job (its nodes share the directory)
    refreshed: float  # the lock file's mtime


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot), None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        if sys.platform.startswith("linux"):
            return None
        try:  # no /proc: existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _when(t: float) -> str:
    fmt = "%H:%M:%S" if time.strftime("%F") == time.strftime("%F", time.localtime(t)) else "%F %T"
    return time.strftime(fmt, time.localtime(t))


def rendezvous_key(rdzv: dict) -> str | None:
    """What the nodes of one multi-node job share, None for a single-node job."""
    nnodes = str(rdzv.get("nnodes") or 1)
    if nnodes.split(":")[-1] == "1":
        return None
    keys = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
    return " ".join(f"{k}={rdzv.get(k)}" for k in keys if rdzv.get(k) is not None) or "default"


def _parse(fd: int) -> Holder | None:
    try:
        raw = os.pread(fd, 1 << 16, 0)
        d = json.loads(raw.decode())
        return Holder(str(d["host"]), str(d.get("boot_id", "")), int(d["pid"]),
                      d.get("pid_start"), float(d["started"]), str(d.get("command", "")),
                      d.get("job"), os.fstat(fd).st_mtime)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_holder(run_dir: Path) -> Holder | None:
    """Who the lock file names (None: no lock, or an unreadable one)."""
    try:
        fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _parse(fd)
    finally:
        os.close(fd)


def _this_boot(h: Holder) -> bool:
    return h.host == socket.gethostname() and h.boot_id == _boot_id()


def gone(h: Holder, now: float | None = None) -> str | None:
    """Why the holder is gone (one phrase), or None while it may be alive."""
    if _this_boot(h):
        start = pid_start(h.pid)
        if start is None:
            return "that process is gone"
        if h.pid_start is not None and start != h.pid_start:
            return "its PID now belongs to another process"
        return None
    # Another host (or this one rebooted): only the refreshes tell.
    idle = (time.time() if now is None else now) - h.refreshed
    if idle > STALE_S:
        return f"its lock was last refreshed {idle:.0f} s ago (limit {STALE_S:.0f} s)"
    return None


def is_live(run_dir: Path | str) -> bool:
    h = read_holder(Path(run_dir))
    return h is not None and gone(h) is None


def _busy(run_dir: str, h: Holder | None, orphans: bool = False) -> RunDirBusy:
    if h is None:
        who = "another job (its lock is held but names no holder)"
    else:
        pid = f"the ranks of pid {h.pid} (gone)" if orphans else f"pid {h.pid}"
        cmd = h.command if len(h.command) <= 120 else h.command[:117] + "..."
        who = f"{pid} on host {h.host} since {_when(h.started)} ({cmd})"
    return RunDirBusy(f"{run_dir} is in use by {who}; stop that job or pick another run.dir")


def _flock(fd: int) -> bool | None:
    """True: locked; False: someone else holds it; None: this file system cannot flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class RunLock:
    """`with RunLock(run_dir, command, job):` holds the run directory (see the module doc).
    `taken_over` says whom it replaced; `peer_of` is set when it joined a multi-node job
    instead of taking the lock."""

    def __init__(self, run_dir: Path | str, command: str = "", job: str | None = None,
                 shown: str | None = None) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.shown = shown or str(run_dir)  # as the user wrote it, for messages
        self.command, self.job = command, job
        self.fd: int | None = None
        self.taken_over: str | None = None  # one line, when a dead job's lock was taken over
        self.peer_of: Holder | None = None
        self._created_dir = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self.fd is not None

    def acquire(self) -> RunLock:
        try:
            if not self.run_dir.exists():
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._created_dir = True
        except OSError as e:
            full = "; free space there or pick another run.dir" if e.errno in (
                errno.ENOSPC, errno.EDQUOT) else ""  # fmt: skip
            raise ValueError(f"cannot create run.dir {self.shown}: {e.strerror}{full}") from None
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self._abandon(None)
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # no inode left
                    raise ValueError(self._unwritable(e)) from None
                raise ValueError(f"cannot lock {self.shown}: {self.path.name}: {e.strerror}; "
                                 "pick a writable run.dir") from None  # fmt: skip
            try:
                if self._try(fd):
                    return self
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        raise RunDirBusy(f"{self.shown}: could not lock {LOCK_NAME} (it keeps changing)")

    def _try(self, fd: int) -> bool:
        """True: done (held, or joined as a peer); False: try again with a fresh descriptor."""
        locked = _flock(fd)
        if locked is False:
            holder = _parse(fd)
            for _ in range(40):  # a holder that just won the lock writes its record next
                if holder is not None or not _same_file(fd, self.path):
                    break
                time.sleep(0.05)
                holder = _parse(fd)
            if not _same_file(fd, self.path):
                return False  # released and removed meanwhile
            if holder is not None and self.job is not None and holder.job == self.job:
                self.peer_of = holder
                return True
            same_host = holder is not None and holder.host == socket.gethostname()
            raise _busy(self.shown, holder, orphans=same_host and pid_start(holder.pid) is None)
        if locked and not _same_file(fd, self.path):
            return False  # we locked a file its holder removed on release: lock the new one
        holder = _parse(fd)
        if holder is not None and holder.pid != os.getpid():
            why = gone(holder)
            if why is None and locked and _this_boot(holder):
                # A live job on this host holds flock() for its whole life: this record is not
                # its lock (a copy of a live run's directory named that job's PID).
                why = "no process holds its lock (a copy of another run's directory?)"
            if why is None:
                if self.job is not None and holder.job == self.job:
                    self.peer_of = holder
                    return True
                raise _busy(self.shown, holder)
            self.taken_over = (f"taking over {self.shown} from pid {holder.pid} on host "
                               f"{holder.host} (started {_when(holder.started)}): {why}")  # fmt: skip
        record = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                  "pid_start": pid_start(os.getpid()), "started": time.time(),
                  "command": self.command, "job": self.job}  # fmt: skip
        data = json.dumps(record).encode()
        try:
            os.ftruncate(fd, 0)
            if os.pwrite(fd, data, 0) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self._abandon(fd)
            raise ValueError(self._unwritable(e)) from None
        self.fd = os.dup(fd)  # the caller closes its own descriptor
        self._thread = threading.Thread(target=self._refresh, name="wanka-run-lock", daemon=True)
        self._thread.start()
        return True

    def _abandon(self, fd: int | None) -> None:
        """A lock file we hold but could not write our record into (`fd`; None: none could be
        made): remove it (an empty wanka.lock names no holder, and would make the next start
        wait for one) and the run directory if we made it for the lock."""
        try:
            if fd is not None and _same_file(fd, self.path):
                self.path.unlink()
        except OSError:
            pass
        if self._created_dir:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass
            self._created_dir = False

    def _unwritable(self, e: OSError) -> str:
        why = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return (f"cannot start in run.dir {self.shown}: its disk is full ({why} while "
                    f"writing {LOCK_NAME}); free space there or pick another run.dir")  # fmt: skip
        return (f"cannot lock {self.shown}: writing {LOCK_NAME} failed ({why}); pick a "
                "writable run.dir")  # fmt: skip

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.fd)
            except (OSError, TypeError):
                pass

    def release(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self.fd is not None:
            try:
                if _same_file(self.fd, self.path):
                    self.path.unlink()  # while still locked: a waiter then retries on a new file
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        if self._created_dir:
            try:
                self.run_dir.rmdir()  # made only for the lock: nothing else ran
            except OSError:
                pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# -- snapshot folders -------------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotFolder:
    path: Path
    run_dir: str | None  # from its owner record; None for a folder without one
    bytes: int  # memory it holds (allocated blocks)
    idle_s: float  # since anything in it last changed
    live: bool  # its run directory is locked by a live job

    def state(self, max_age_h: float) -> str:
        if self.live:
            return "live"
        if self.run_dir is None:  # not made by wanka (or not recognisably): never removed
            return "other"
        return "stale" if max_age_h > 0 and self.idle_s > max_age_h * 3600 else "idle"


def write_owner(snapshot_dir: Path | str, job: str, run_dir: Path | str) -> None:
    """Record which run directory the job folder's snapshots belong to."""
    d = Path(snapshot_dir) / job
    d.mkdir(parents=True, exist_ok=True)
    record = {"job": job, "run_dir": str(Path(run_dir).resolve()), "host": socket.gethostname(),
              "created": time.time()}  # fmt: skip
    tmp = d / f".{OWNER}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, d / OWNER)


def drop_owner_if_alone(job_dir: Path | str) -> None:
    """Remove the owner record and the job folder once no snapshot is left in it."""
    d = Path(job_dir)
    try:
        if {p.name for p in d.iterdir()} <= {OWNER}:
            (d / OWNER).unlink(missing_ok=True)
            d.rmdir()
    except OSError:
        pass  # another rank's files arrived, or it is gone already


def _usage(d: Path) -> tuple[int, float]:
    """(allocated bytes, newest mtime) of a folder tree."""
    size, newest = 0, 0.0
    for root, dirs, files in os.walk(d):
        for name in [*dirs, *files, "."]:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if name in files:
                size += st.st_blocks * 512
    return size, newest


def snapshot_folders(snapshot_dir: Path | str) -> list[SnapshotFolder]:
    root, now, out = Path(snapshot_dir), time.time(), []
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return []
    for d in entries:
        try:
            record = json.loads((d / OWNER).read_text())
            run_dir = str(record["run_dir"]) if record["job"] == d.name else None
        except (OSError, ValueError, KeyError, TypeError):
            run_dir = None
        size, newest = _usage(d)
        live = run_dir is not None and is_live(run_dir)
        out.append(SnapshotFolder(d, run_dir, size, max(now - newest, 0.0), live))
    return out


def remove_folder(f: SnapshotFolder) -> bool:
    shutil.rmtree(f.path, ignore_errors=True)
    return not f.path.exists()


def sweep_snapshots(snapshot_dir: Path | str, max_age_h: float,
                    current: str | None = None) -> list[SnapshotFolder]:  # fmt: skip
    """At job start: remove job folders idle longer than `max_age_h` hours (never `current`,
    never one whose run directory a live job holds). 0 or less: never."""
    if max_age_h <= 0:
        return []
    return [f for f in snapshot_folders(snapshot_dir)
            if f.path.name != current and f.state(max_age_h) == "stale" and remove_folder(f)]  # fmt: skip


def swept_line(f: SnapshotFolder, max_age_h: float, node: str | None = None) -> str:
    """What the start-of-job sweep says about a folder it removed (`node`: in that node's own
    memory, on the cluster-in-a-box)."""
    of = f"of node {node} " if node else ""
    return (f"removed stale snapshots {of}{f.path} ({human_bytes(f.bytes)}, run dir "
            f"{f.run_dir or 'unknown'}, idle {human_age(f.idle_s)} > "
            f"resilience.snapshot_max_age_h={max_age_h:g})")  # fmt: skip


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def folder_lines(folders: list[SnapshotFolder], max_age_h: float) -> list[str]:
    """A table of snapshot folders: job, run dir, size, idle time, state."""
    lines = [f"{'job':28s} {'size':>10s} {'idle':>8s}  {'state':5s}  run dir"]
    for f in folders:
        lines.append(f"{f.path.name:28s} {human_bytes(f.bytes):>10s} {human_age(f.idle_s):>8s}  "
                     f"{f.state(max_age_h):5s}  "
                     f"{f.run_dir or '- (no wanka owner record: left alone)'}")  # fmt: skip
    return lines


def command_line(argv: list[str]) -> str:
    return shlex.join(["wanka", *argv])


MIN_FREE = 1 << 20  # bytes a job needs in its run directory for its records and logs


def _check_room(run_dir: Path, shown: str) -> None:
    """A run directory on a full disk fails here in one line, not in a traceback from the
    first of the job's own records that cannot be written."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return
    if free < MIN_FREE:
        raise ValueError(f"cannot start in run.dir {shown}: its disk is full ({free >> 10} KiB "
                         "free); free space there or pick another run.dir")  # fmt: skip


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StoppedBeforeStart(BaseException):  # past `except Exception` on its way out
    """A stop request before the job launched anything: nothing ran, nothing to save."""


_BEFORE_START: dict = {}  # signal -> the handler job_start() replaced


def launching() -> None:
    """The job starts now (torchrun's agent, the cluster launcher, or training in this very
    process): stop requests are theirs from here on, not "nothing ran"."""
    for sig, handler in _BEFORE_START.items():
        if signal.getsignal(sig) is _stop_before_start:
            signal.signal(sig, handler)
    _BEFORE_START.clear()


def _stop_before_start(signum: int, _frame) -> None:
    raise StoppedBeforeStart(f"stopped on request ({signal.Signals(signum).name}) before the job "
                             "started: nothing ran; run the same command again to start it")  # fmt: skip


@contextmanager
def job_start(cfg, rdzv: dict, argv: list[str]) -> Iterator[RunLock]:
    """What the top-level `wanka train` does before it launches anything, and holds until the
    job ends: lock the run directory (or join the multi-node job holding it), then, with no
    writer left, remove the `.partial-` directories of a save that never finished and sweep
    stale snapshot folders. Each action is one line on stderr."""
    run_dir = Path(cfg.run.dir)
    lock = RunLock(run_dir, command_line(argv), rendezvous_key(rdzv)).acquire()
    # Until the supervisor (or torchrun's agent, or the trainer) installs its own handlers
    # (imports and pre-flight take seconds), a stop request killed this process silently
    # and left the lock behind.
    _BEFORE_START.update({sig: signal.signal(sig, _stop_before_start) for sig in STOP_SIGNALS})
    try:

        def say(msg: str) -> None:
            print(f"wanka train: {msg}", file=sys.stderr, flush=True)

        if lock.taken_over:
            say(lock.taken_over)
        if lock.held:
            _check_room(run_dir, lock.shown)
            from wanka.train.checkpoint import remove_partials

            for p in remove_partials(run_dir / "checkpoints"):
                what = "deletion of an old checkpoint" if "pruned-" in p.name else "checkpoint save"
                say(f"removed {p}: left by a {what} that never finished")
        try:
            current = (run_dir / "resilience" / "job_id").read_text().strip()
        except OSError:
            current = None
        max_age = cfg.resilience.snapshot_max_age_h
        for f in sweep_snapshots(cfg.resilience.snapshot_dir, max_age, current):
            say(swept_line(f, max_age))
        yield lock
    finally:
        launching()  # (if nothing did): the handlers as they were
        lock.release()
