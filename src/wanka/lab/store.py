"""SQLite history of every candidate: source, configuration, feedback, timings, verdict,
and the held-out check. A run is (task, proposer, budget); an unfinished run is picked up
again by the next `wanka lab run` for the same task and proposer (resumable).

Integrity: only the parent process (runner.py) writes the history. Each candidate row
carries the SHA-256 of its exact source and an HMAC-SHA256 over its verdict-bearing fields,
keyed by a per-history secret in `<db>.key` (0600, next to the DB). Someone who can write
the DB but not read the key cannot forge or edit a verdict without `verify` noticing; rows
recorded before this check (no MAC) count as unverified.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from wanka.lab.evaluator import Feedback
from wanka.lab.task import LabError

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY, task TEXT NOT NULL, proposer TEXT NOT NULL, budget INTEGER,
  created REAL, finished REAL, options TEXT);
CREATE TABLE IF NOT EXISTS candidates (
  id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id), n INTEGER,
  created REAL, source TEXT, config TEXT, note TEXT, status TEXT, correct INTEGER,
  time_s REAL, baseline_s REAL, reference_s REAL, speedup REAL, feedback TEXT,
  held_out_ok INTEGER, held_out_speedup REAL, held_out TEXT,
  source_sha256 TEXT, mac TEXT);
"""
# Columns added after the first schema: ALTER TABLE'd into older histories on open.
MIGRATIONS = (("source_sha256", "TEXT"), ("mac", "TEXT"))
COLUMNS = ("id, run_id, n, created, source, config, note, status, correct, time_s, baseline_s,"
           " reference_s, speedup, feedback, held_out_ok, held_out_speedup, source_sha256, mac")  # fmt: skip
KEY_BYTES = 32


def sha256_text(source: str) -> str:
    """Hex SHA-256 of the exact source text (UTF-8)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Record:
    id: int
    run_id: int
    n: int
    created: float
    source: str
    config: dict | None
    note: str
    status: str
    correct: bool
    time_s: float | None
    baseline_s: float | None
    reference_s: float | None
    speedup: float | None
    feedback: Feedback
    held_out_ok: bool | None
    held_out_speedup: float | None
    source_sha256: str | None = None
    mac: str | None = None


@dataclass(frozen=True)
class Run:
    id: int
    task: str
    proposer: str
    budget: int
    created: float
    finished: float | None
    options: dict


class Store:
    def __init__(self, path: str | Path, key_path: str | Path | None = None):
        """key_path: the history's secret (default `<db>.key`; tests point it elsewhere)."""
        self.path = Path(path)
        self.key_path = Path(key_path) if key_path is not None else Path(f"{self.path}.key")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # create the DB file 0600 ourselves, so it is never world-readable, even briefly
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.chmod(self.path, 0o600)  # umask may have masked bits; sqlite keeps the mode
        except FileExistsError:
            pass
        self.db = sqlite3.connect(self.path)
        self.db.executescript(SCHEMA)
        have = {r[1] for r in self.db.execute("PRAGMA table_info(candidates)")}
        for col, kind in MIGRATIONS:
            if col not in have:
                self.db.execute(f"ALTER TABLE candidates ADD COLUMN {col} {kind}")
        self.db.commit()
        self._key: bytes | None = None
        self._key_error: str | None = None

    def close(self) -> None:
        self.db.close()

    # --- the secret -------------------------------------------------------------------------
    def key(self) -> bytes:
        """The history's HMAC key, created on first use. A missing key for a history that
        already holds MACs is an error, never silently replaced (that would orphan them)."""
        if self._key is not None:
            return self._key
        try:
            key = self.key_path.read_bytes()
        except FileNotFoundError:
            macs = self.db.execute(
                "SELECT COUNT(*) FROM candidates WHERE mac IS NOT NULL"
            ).fetchone()[0]
            if macs:
                raise LabError(
                    f"key file {self.key_path} is missing but {self.path} holds {macs} signed "
                    "records: restore the key (a new one would make them all unverifiable)"
                ) from None
            key = self._create_key()
        if len(key) != KEY_BYTES:
            raise LabError(f"key file {self.key_path} is not a {KEY_BYTES}-byte key")
        self._key = key
        return key

    def _create_key(self) -> bytes:
        key = secrets.token_bytes(KEY_BYTES)
        try:
            fd = os.open(self.key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process created it first: use theirs
            return self.key_path.read_bytes()
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key

    def _mac(self, rec: Record, task: str) -> str:
        body = {
            "run_id": rec.run_id, "n": rec.n, "task": task, "source_sha256": rec.source_sha256,
            "status": rec.status, "correct": bool(rec.correct), "time_s": _num(rec.time_s),
            "baseline_s": _num(rec.baseline_s), "reference_s": _num(rec.reference_s),
            "speedup": _num(rec.speedup),
            "held_out_ok": None if rec.held_out_ok is None else bool(rec.held_out_ok),
            "held_out_speedup": _num(rec.held_out_speedup), "config": rec.config,
        }  # fmt: skip
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hmac.new(self.key(), canon.encode(), hashlib.sha256).hexdigest()

    def task_of(self, run_id: int) -> str | None:
        """The task of a run (None when there is no such run)."""
        row = self.db.execute("SELECT task FROM runs WHERE id=?", (run_id,)).fetchone()
        return row[0] if row else None

    def _sign(self, cand_id: int) -> None:
        """(Re)compute a row's MAC from the row as the DB returns it, so that what is signed
        is exactly what `verify` will later see (REAL columns, JSON round trips)."""
        rec = self.candidate(cand_id)
        mac = self._mac(rec, self.task_of(rec.run_id) or "")
        self.db.execute("UPDATE candidates SET mac=? WHERE id=?", (mac, cand_id))

    def verify(self, rec: Record) -> str | None:
        """None when the record is intact, else one line saying why it is not."""
        if not isinstance(rec.mac, str):
            return "missing MAC (recorded before history integrity checks, or forged)"
        if not isinstance(rec.source_sha256, str) or not _same(
            rec.source_sha256, sha256_text(rec.source)
        ):
            return "source hash mismatch (the source was changed after it was evaluated)"
        task = self.task_of(rec.run_id)
        if task is None:
            return f"its run {rec.run_id} is missing from the history"
        try:
            want = self._mac(rec, task)
        except LabError as e:
            return str(e)
        if not _same(rec.mac, want):
            return "MAC mismatch (the row was written or edited outside wanka lab)"
        return None

    # --- runs and candidates ------------------------------------------------------------------
    def start_run(self, task: str, proposer: str, budget: int, options: dict) -> int:
        cur = self.db.execute(
            "INSERT INTO runs (task, proposer, budget, created, options) VALUES (?,?,?,?,?)",
            (task, proposer, budget, time.time(), json.dumps(options)),
        )
        self.db.commit()
        return int(cur.lastrowid)

    def resumable(self, task: str, proposer: str) -> int | None:
        row = self.db.execute(
            "SELECT id FROM runs WHERE task=? AND proposer=? AND finished IS NULL "
            "ORDER BY id DESC LIMIT 1", (task, proposer)).fetchone()  # fmt: skip
        return int(row[0]) if row else None

    def set_budget(self, run_id: int, budget: int) -> None:
        self.db.execute("UPDATE runs SET budget=?, finished=NULL WHERE id=?", (budget, run_id))
        self.db.commit()

    def finish(self, run_id: int) -> None:
        self.db.execute("UPDATE runs SET finished=? WHERE id=?", (time.time(), run_id))
        self.db.commit()

    def add(self, run_id: int, source: str, config: dict | None, note: str, fb: Feedback, *,
            source_sha256: str) -> int:  # fmt: skip
        """Record one evaluation. source_sha256: computed by the caller from the exact string
        it passed to evaluate (never from anything the candidate's process reported)."""
        if sha256_text(source) != source_sha256:
            raise LabError("source_sha256 does not match the source being recorded")
        self.key()  # fail before writing when the key is missing: no unsigned rows
        n = self.db.execute("SELECT COUNT(*) FROM candidates WHERE run_id=?", (run_id,)).fetchone()[
            0
        ]
        cur = self.db.execute(
            "INSERT INTO candidates (run_id, n, created, source, config, note, status, correct,"
            " time_s, baseline_s, reference_s, speedup, feedback, source_sha256)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, n + 1, time.time(), source, json.dumps(config) if config is not None else None,
             note, fb.status, int(fb.correct), fb.time_s, fb.baseline_s, fb.reference_s,
             fb.speedup, json.dumps(fb.to_dict()), source_sha256),
        )  # fmt: skip
        self._sign(int(cur.lastrowid))  # same transaction: the row never exists unsigned
        self.db.commit()
        return int(cur.lastrowid)

    def set_held_out(self, cand_id: int, fb: Feedback) -> None:
        # Re-signing a row that does not verify would launder a forged one: refuse.
        why = self.verify(self.candidate(cand_id))
        if why:
            raise LabError(f"candidate {cand_id} failed the integrity check: {why}")
        self.db.execute(
            "UPDATE candidates SET held_out_ok=?, held_out_speedup=?, held_out=? WHERE id=?",
            (int(fb.correct), fb.speedup, json.dumps(fb.to_dict()), cand_id),
        )
        self._sign(cand_id)
        self.db.commit()

    def run(self, run_id: int) -> Run:
        row = self.db.execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(run_id)
        return Run(row[0], row[1], row[2], row[3], row[4], row[5], json.loads(row[6] or "{}"))

    def runs(self, task: str | None = None) -> list[Run]:
        q, args = "SELECT id FROM runs", ()
        if task:
            q, args = q + " WHERE task=?", (task,)
        return [self.run(r[0]) for r in self.db.execute(q + " ORDER BY id", args).fetchall()]

    def candidates(self, run_id: int) -> list[Record]:
        rows = self.db.execute(
            f"SELECT {COLUMNS} FROM candidates WHERE run_id=? ORDER BY n", (run_id,)
        ).fetchall()
        return [_record(r) for r in rows]

    def candidate(self, cand_id: int) -> Record:
        row = self.db.execute(f"SELECT {COLUMNS} FROM candidates WHERE id=?", (cand_id,)).fetchone()
        if row is None:
            raise KeyError(cand_id)
        return _record(row)


def _same(a: str, b: str) -> bool:
    # bytes: compare_digest refuses non-ASCII str, and a forged row may hold anything
    return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode("utf-8", "replace"))


def _num(x: float | None) -> float | None:
    # SQLite REAL columns hand back floats even for ints stored: sign the float form.
    return None if x is None else float(x)


def _record(r) -> Record:
    # Tolerant of rows written outside wanka lab: they must still load (and fail `verify`)
    # rather than break the report.
    try:
        fb = Feedback.from_dict(json.loads(r[13]))
    except (TypeError, ValueError):
        fb = Feedback("error", "unreadable feedback in the history")
    try:
        config = json.loads(r[5]) if r[5] else None
    except ValueError:
        config = None
    return Record(
        id=r[0], run_id=r[1], n=r[2], created=r[3], source=r[4] if isinstance(r[4], str) else "",
        config=config,
        note=r[6] or "", status=r[7], correct=bool(r[8]), time_s=r[9], baseline_s=r[10],
        reference_s=r[11], speedup=r[12], feedback=fb,
        held_out_ok=None if r[14] is None else bool(r[14]), held_out_speedup=r[15],
        source_sha256=r[16], mac=r[17],
    )  # fmt: skip
