"""Persistent fault ledger (SQLite) and the node-eviction policy.

Every fault the supervisor sees is recorded with its node, rank, cause and time. The ledger
outlives jobs, so a node that keeps failing across resubmissions is recognised and evicted
(DESIGN.md section 4, issue 5 capability 4). Several processes (supervisors of different jobs,
`wanka nodes`) may use one file at once: WAL mode and a busy time-out make that safe.

Clearing a node does not delete its history (operators want to see it): it moves a per-node
watermark past the node's newest fault id, and only faults above the watermark count toward
the policy. Ids rather than times, so that a fault recorded later with an earlier timestamp
(clock skew between machines) still counts.
"""

from __future__ import annotations

import errno
import shutil
import sqlite3
import time as _time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Causes that say something about the machine, so repeating them is grounds for eviction.
NODE_CAUSES = {"node_down", "node_lost", "startup_failure", "hang", "slow", "link"}
# Causes that follow the job (its code, data or scheduler), not the machine.
OTHER_CAUSES = {
    "process_crash",
    "nan",
    "preempted",
    "checkpoint_corrupt",
    "user_error",
    "user_code",
}
ALL_CAUSES = NODE_CAUSES | OTHER_CAUSES

# The faults that count toward eviction (and in `wanka nodes`' counted column): not injected
# by a drill, not the job's own error. One condition, so that the two never disagree.
COUNTS_SQL = "injected = 0 AND cause NOT IN ('user_error', 'user_code')"

_BUSY_TIMEOUT_S = 30.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS faults (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    job TEXT NOT NULL,
    node TEXT NOT NULL,
    rank INTEGER,
    cause TEXT NOT NULL,
    step INTEGER,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS faults_node_time ON faults (node, time);
CREATE TABLE IF NOT EXISTS nodes (
    node TEXT PRIMARY KEY,
    evicted INTEGER NOT NULL DEFAULT 0,
    reason TEXT NOT NULL DEFAULT '',
    evicted_at REAL,
    cleared_at REAL,
    cleared_id INTEGER NOT NULL DEFAULT 0
);
"""


def _is_busy(e: sqlite3.Error) -> bool:
    return isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e))


def _space(path: Path, msg: str) -> str:
    """SQLite's words for a write that failed, and whether the disk is full (a full tmpfs
    reads as "disk I/O error": the write-ahead log could not grow)."""
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return msg
    return f"{msg}; its disk is full ({free} bytes free)" if free < 1 << 20 else msg


def _set_wal(db: sqlite3.Connection) -> None:
    # Switching the journal mode needs an exclusive lock and SQLite does not call the busy
    # handler for it, so two processes opening a new ledger at once would fail: retry.
    deadline = _time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if not _is_busy(e) or _time.monotonic() > deadline:
                raise
            _time.sleep(0.02)


@dataclass
class Fault:
    id: int
    time: float
    job: str
    node: str
    rank: int | None
    cause: str
    step: int | None
    detail: str


@dataclass
class EvictionPolicy:
    """Evict a node with >= max_faults faults of any cause within window_s, or >= same_cause
    faults of one node-attributable cause (NODE_CAUSES) within window_s. 0 disables a rule."""

    max_faults: int = 3
    window_s: float = 3600.0
    same_cause: int = 2


class FaultLedger:
    """The fault ledger in one SQLite file. Each call opens its own short-lived connection,
    so an instance is safe to use after fork and from several threads."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        """Open (and with create=True make) the ledger. create=False is for read-only tools
        such as `wanka nodes`: a missing file is then an error rather than a new empty ledger."""
        self.path = Path(path)
        if not self.path.exists():
            if not create:
                raise ValueError(
                    f"no fault ledger at {self.path}: run a supervised job first, "
                    "or pass --ledger PATH"
                )
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                why = (
                    "a file is in the way"
                    if e.errno in (errno.EEXIST, errno.ENOTDIR)
                    else e.strerror
                )
                raise ValueError(f"cannot make the fault ledger's folder {self.path.parent} "
                                 f"({why}): set resilience.ledger to a path in a "
                                 "writable directory") from None  # fmt: skip
        with self._db(write=True, wal=True) as db:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            columns = {row[1] for row in db.execute("PRAGMA table_info(faults)")}
            if "injected" not in columns:  # a ledger from before injected faults were marked
                db.execute("ALTER TABLE faults ADD COLUMN injected INTEGER NOT NULL DEFAULT 0")

    @contextmanager
    def _db(self, write: bool = False, wal: bool = False) -> Iterator[sqlite3.Connection]:
        """A connection in one transaction; any SQLite failure becomes a one-line ValueError
        naming the file, which the CLI prints as is."""
        db = None
        try:
            db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
            db.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
            if wal:
                # WAL lets readers (`wanka nodes`) run while a supervisor writes. The mode is
                # stored in the file, so setting it once when opening the ledger is enough.
                _set_wal(db)
            # Writers take the write lock up front: a deferred transaction that upgrades from
            # read to write can fail with SQLITE_BUSY without waiting on the busy handler.
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            yield db
            db.execute("COMMIT")
        except sqlite3.DatabaseError as e:
            if db is not None and db.in_transaction:
                db.execute("ROLLBACK")
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if _is_busy(e):
                raise ValueError(
                    f"fault ledger {self.path} stayed locked for {_BUSY_TIMEOUT_S:g} s ({msg}): "
                    "is a process holding it stuck?"
                ) from None
            if "full" in msg or "disk I/O" in msg:  # SQLITE_FULL, SQLITE_IOERR
                said = _space(self.path, msg)
                fix = ("free space there" if said != msg or "full" in msg else "check that "
                       "disk (a network filesystem's locking, say)")  # fmt: skip
                raise ValueError(f"fault ledger {self.path}: {said}: {fix}, or point "
                                 "resilience.ledger at another disk") from None  # fmt: skip
            raise ValueError(
                f"fault ledger {self.path} is unusable ({msg}): if it is an old ledger, move it "
                "aside to start a new one; if it is another file, point resilience.ledger "
                "elsewhere (e.g. .cache/wanka/faults.sqlite)"
            ) from None
        finally:
            if db is not None:
                db.close()

    def record(
        self,
        job: str,
        node: str,
        rank: int | None,
        cause: str,
        step: int | None = None,
        detail: str = "",
        time: float | None = None,
        injected: bool = False,
    ) -> Fault:
        """Append one fault; time defaults to now. Unknown causes are rejected because the
        same-cause rule matches on the exact string: a typo would silently never evict.
        Injected faults (chaos drills) are kept for the record but never count toward
        eviction; neither do user errors."""
        if cause not in ALL_CAUSES:
            raise ValueError(
                f"unknown fault cause {cause!r}: one of {', '.join(sorted(ALL_CAUSES))}"
            )
        t = _time.time() if time is None else float(time)
        with self._db(write=True) as db:
            cur = db.execute(
                "INSERT INTO faults (time, job, node, rank, cause, step, detail, injected) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (t, job, node, rank, cause, step, detail, int(injected)),
            )
            fid = int(cur.lastrowid or 0)
        return Fault(fid, t, job, node, rank, cause, step, detail)

    def faults(self, node: str | None = None, since: float | None = None) -> list[Fault]:
        """All recorded faults (cleared ones included), oldest first."""
        sql = "SELECT id, time, job, node, rank, cause, step, detail FROM faults WHERE 1=1"
        args: list[object] = []
        if node is not None:
            sql += " AND node = ?"
            args.append(node)
        if since is not None:
            sql += " AND time >= ?"
            args.append(since)
        with self._db() as db:
            rows = db.execute(sql + " ORDER BY time, id", args).fetchall()
        return [Fault(*r) for r in rows]

    def _counted(self, db: sqlite3.Connection, node: str, since: float, now: float) -> list[str]:
        """Causes of the node's faults in (since, now] that are not cleared."""
        row = db.execute("SELECT cleared_id FROM nodes WHERE node = ?", (node,)).fetchone()
        cleared_id = row[0] if row else 0
        rows = db.execute(
            "SELECT cause FROM faults WHERE node = ? AND id > ? AND time > ? AND time <= ? "
            f"AND {COUNTS_SQL} ORDER BY time, id",
            (node, cleared_id, since, now),
        ).fetchall()
        return [r[0] for r in rows]

    def evaluate(self, node: str, policy: EvictionPolicy, now: float | None = None) -> str | None:
        """The reason to evict node under policy, or None. Pure: it does not evict."""
        now = _time.time() if now is None else float(now)
        with self._db() as db:
            causes = self._counted(db, node, now - policy.window_s, now)
        window = f"{policy.window_s:g} s"
        if policy.max_faults > 0 and len(causes) >= policy.max_faults:
            return f"{len(causes)} faults within {window} ({', '.join(causes)})"
        if policy.same_cause > 0:
            # Most frequent node cause first, so the reason names the worst offender.
            for cause, n in Counter(c for c in causes if c in NODE_CAUSES).most_common():
                if n >= policy.same_cause:
                    return f"{n} x {cause} within {window}"
        return None

    def evict(self, node: str, reason: str) -> None:
        with self._db(write=True) as db:
            db.execute(
                "INSERT INTO nodes (node, evicted, reason, evicted_at) VALUES (?, 1, ?, ?) "
                "ON CONFLICT (node) DO UPDATE SET evicted = 1, reason = excluded.reason, "
                "evicted_at = excluded.evicted_at",
                (node, reason, _time.time()),
            )

    def evicted(self) -> dict[str, str]:
        """node -> reason, for the nodes evicted now."""
        with self._db() as db:
            rows = db.execute("SELECT node, reason FROM nodes WHERE evicted = 1 ORDER BY node")
            return dict(rows.fetchall())

    def clear(self, node: str) -> None:
        """Put node back: not evicted, and its faults so far no longer count for the policy."""
        with self._db(write=True) as db:
            top = db.execute("SELECT COALESCE(MAX(id), 0) FROM faults WHERE node = ?", (node,))
            cleared_id = top.fetchone()[0]
            db.execute(
                "INSERT INTO nodes (node, evicted, reason, cleared_at, cleared_id) "
                "VALUES (?, 0, '', ?, ?) ON CONFLICT (node) DO UPDATE SET evicted = 0, "
                "reason = '', cleared_at = excluded.cleared_at, cleared_id = excluded.cleared_id",
                (node, _time.time(), cleared_id),
            )

    def known(self, node: str) -> bool:
        """Whether the ledger has any fault or status for node."""
        with self._db() as db:
            q = "SELECT 1 FROM faults WHERE node = ? UNION SELECT 1 FROM nodes WHERE node = ?"
            return db.execute(q, (node, node)).fetchone() is not None

    def summary(self) -> list[dict]:
        """Per node, sorted by name: faults (total), counted (not cleared, and counting toward
        eviction as _counted does), by_cause, last_cause, last_time, status ("evicted" | "ok"),
        reason."""
        with self._db() as db:
            faults = db.execute(
                f"SELECT id, node, cause, time, {COUNTS_SQL} FROM faults ORDER BY time, id"
            )
            faults = faults.fetchall()
            status = {
                r[0]: r[1:]
                for r in db.execute("SELECT node, evicted, reason, cleared_id FROM nodes")
            }
        out: dict[str, dict] = {}
        for node in sorted({f[1] for f in faults} | set(status)):
            evicted, reason, cleared_id = status.get(node, (0, "", 0))
            out[node] = {
                "node": node,
                "faults": 0,
                "counted": 0,
                "by_cause": {},
                "last_cause": None,
                "last_time": None,
                "status": "evicted" if evicted else "ok",
                "reason": reason,
                "_cleared_id": cleared_id,
            }
        for fid, node, cause, t, counts in faults:
            s = out[node]
            s["faults"] += 1
            s["counted"] += bool(counts) and fid > s["_cleared_id"]
            s["by_cause"][cause] = s["by_cause"].get(cause, 0) + 1
            s["last_cause"], s["last_time"] = cause, t
        for s in out.values():
            del s["_cleared_id"]
        return list(out.values())
