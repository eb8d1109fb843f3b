"""SQLite history of every candidate: source, configuration, feedback, timings, verdict,
and the held-out check. A run is (task, proposer, budget); an unfinished run is picked up
again by the next `wanka lab run` for the same task and proposer (resumable).

Integrity: only the parent process (runner.py) writes the history. Everything is signed with
HMAC-SHA256, keyed by a per-history secret in `<db>.key` (0600, next to the DB), so someone
who can write the DB but not read the key cannot forge, edit, delete, duplicate, reorder or
move a record without `audit`/`verify` noticing:
- each candidate row carries the SHA-256 of its exact source and a MAC over every column
  as stored (its id, run, position `n`, the id of the evaluation before it `prev`, verdict,
  timings, feedback, note, ...) and over its run's identity (random nonce and task);
- each run carries a MAC over its record, including how many evaluations it holds and the
  id of the last one, so a deleted, duplicated or reordered row breaks the run's sequence.
Histories written before this format (rows signed without their position, runs unsigned;
the runs table has no nonce) stay readable; their rows are "unverifiable (older format)".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import time
from pathlib import Path

from wanka.lab.evaluator import Feedback
from wanka.lab.records import (
    COLUMNS,
    OLDER,
    RUN_COLUMNS,
    RUN_SIGNED,
    SIGNED,
    Audit,
    Record,
    Run,
    RunRow,
    canon,
    decode_text,
    parse_record,
    parse_run_row,
    sequence_problem,
    sha256_text,
)
from wanka.lab.task import LabError

__all__ = ["OLDER", "Audit", "Record", "Run", "Store", "sha256_text"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY, task TEXT NOT NULL, proposer TEXT NOT NULL, budget INTEGER,
  created REAL, finished REAL, options TEXT, nonce TEXT, evals INTEGER, head INTEGER, mac TEXT);
CREATE TABLE IF NOT EXISTS candidates (
  id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id), n INTEGER,
  created REAL, source TEXT, config TEXT, note TEXT, status TEXT, correct INTEGER,
  time_s REAL, baseline_s REAL, reference_s REAL, speedup REAL, feedback TEXT,
  held_out_ok INTEGER, held_out_speedup REAL, held_out TEXT,
  source_sha256 TEXT, mac TEXT, prev INTEGER);
"""
# Columns added after the first schema: ALTER TABLE'd into older histories on open.
MIGRATIONS = {
    "candidates": (("source_sha256", "TEXT"), ("mac", "TEXT"), ("prev", "INTEGER")),
    "runs": (("nonce", "TEXT"), ("evals", "INTEGER"), ("head", "INTEGER"), ("mac", "TEXT")),
}
# Every stored column of a candidate but its MAC: all of them are signed, as stored.
KEY_BYTES = 32
FORMAT = "v2"  # the MAC format of this schema; a MAC of the older format is bare hex
OLDER_RUN = f"{OLDER}: its runs and row positions were not signed yet)"
OLDER_ROW = f"{OLDER}: signed before rows were bound to their run and position)"
OLDER_UNSIGNED = f"{OLDER}: recorded before history integrity checks)"
MISSING_MAC = "missing MAC (recorded before history integrity checks, or forged)"


class Store:
    def __init__(self, path: str | Path, key_path: str | Path | None = None):
        """key_path: the history's secret (default `<db>.key`; tests point it elsewhere)."""
        self.path = Path(path)
        self.key_path = Path(key_path) if key_path is not None else Path(f"{self.path}.key")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LabError(f"--db {self.path}: cannot create its folder ({e.strerror}): pass "
                           "another path") from None  # fmt: skip
        try:  # create the DB file 0600 ourselves, so it is never world-readable, even briefly
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            os.chmod(self.path, 0o600)  # umask may have masked bits; sqlite keeps the mode
        except FileExistsError:
            pass
        except OSError as e:  # a folder there, a read-only disk
            raise LabError(f"--db {self.path} cannot be created ({e.strerror}): pass another "
                           "path") from None  # fmt: skip
        try:
            self.db = sqlite3.connect(self.path)
            self.db.text_factory = decode_text  # bad UTF-8 in a TEXT column: tampering
            self.db.executescript(SCHEMA)
            for table, cols in MIGRATIONS.items():
                have = {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}
                for col, kind in cols:
                    if col not in have:
                        self.db.execute(f"ALTER TABLE {table} ADD COLUMN {col} {kind}")
            self.db.commit()
        except sqlite3.Error as e:
            raise LabError(f"--db {self.path} is not a usable lab history ({e}): pass another "
                           "path (a new one starts an empty history)") from None  # fmt: skip
        self._key: bytes | None = None

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
            macs = sum(
                self.db.execute(f"SELECT COUNT(*) FROM {t} WHERE mac IS NOT NULL").fetchone()[0]
                for t in ("candidates", "runs")
            )
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

    def _hmac(self, body: dict) -> str:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          default=canon)  # fmt: skip
        return hmac.new(self.key(), text.encode(), hashlib.sha256).hexdigest()

    def _mac(self, raw: tuple, run: RunRow) -> str:
        """The MAC of a candidate row as stored, bound to its run's identity."""
        body = {"kind": "candidate", "run_nonce": run.nonce, "task": run.task,
                "row": dict(zip(SIGNED, raw[: len(SIGNED)], strict=True))}  # fmt: skip
        return f"{FORMAT}:{self._hmac(body)}"

    def _run_mac(self, run: RunRow) -> str:
        body = {
            "kind": "run",
            "run": dict(zip(RUN_SIGNED, run.raw[: len(RUN_SIGNED)], strict=True)),
        }
        return f"{FORMAT}:{self._hmac(body)}"

    def _mac_v1(self, rec: Record, task: str) -> str:
        """The older format's MAC (verdict fields only), to tell an older row from a forged
        one; such a row is never trusted, whichever it is."""
        body = {
            "run_id": rec.run_id, "n": rec.n, "task": task, "source_sha256": rec.source_sha256,
            "status": rec.status, "correct": bool(rec.correct), "time_s": rec.time_s,
            "baseline_s": rec.baseline_s, "reference_s": rec.reference_s,
            "speedup": rec.speedup,
            "held_out_ok": None if rec.held_out_ok is None else bool(rec.held_out_ok),
            "held_out_speedup": rec.held_out_speedup, "config": rec.config,
        }  # fmt: skip
        return self._hmac(body)

    def _run_row(self, run_id: int) -> RunRow | None:
        row = self.db.execute(f"SELECT {RUN_COLUMNS} FROM runs WHERE id=?", (run_id,)).fetchone()
        return None if row is None else parse_run_row(row)

    def task_of(self, run_id: int) -> str | None:
        """The task of a run (None when there is no such run)."""
        run = self._run_row(run_id)
        return run.task if run else None

    def _sign(self, cand_id: int, run: RunRow) -> None:
        """(Re)compute a row's MAC from the row as the DB returns it, so that what is signed
        is exactly what `verify` will later see."""
        mac = self._mac(self.candidate(cand_id).raw, run)
        self.db.execute("UPDATE candidates SET mac=? WHERE id=?", (mac, cand_id))

    def _sign_run(self, run_id: int) -> None:
        mac = self._run_mac(self._run_row(run_id))
        self.db.execute("UPDATE runs SET mac=? WHERE id=?", (mac, run_id))

    def _record_problem(self, run: RunRow | None) -> str | None:
        """Why a run's own record cannot be trusted (None when it can)."""
        if run is None:
            return "its run record is missing from the history"
        if run.nonce is None:
            return OLDER_RUN
        if run.malformed:
            return f"run record: {run.malformed}"
        if not isinstance(run.mac, str):
            return "run record MAC missing (written outside wanka lab)"
        try:
            want = self._run_mac(run)
        except LabError as e:
            return str(e)
        if not _same(run.mac, want):
            return "run record MAC mismatch (the run was edited outside wanka lab)"
        return None

    def _check(self, rec: Record, run: RunRow | None) -> tuple[str | None, bool]:
        """(why the row is not intact or None, whether its MAC holds: it is the run's own
        evaluation at position n, whatever else is wrong with it)."""
        if rec.malformed:
            return rec.malformed, False
        if run is None:
            return f"its run {rec.run_id} is missing from the history", False
        older = run.nonce is None
        if not isinstance(rec.mac, str):
            return (OLDER_UNSIGNED if older else MISSING_MAC), False
        try:
            want = self._mac_v1(rec, run.task) if older else self._mac(rec.raw, run)
        except LabError as e:
            return str(e), False
        mac_ok = _same(rec.mac, want)
        if not _same(rec.source_sha256, sha256_text(rec.source)):
            return "source hash mismatch (the source was changed after it was evaluated)", (
                mac_ok and not older
            )
        if not mac_ok:
            return "MAC mismatch (the row was written, edited or moved outside wanka lab)", False
        return (OLDER_ROW, False) if older else (None, True)

    def verify(self, rec: Record) -> str | None:
        """None when the row is intact (it is exactly the row its run's process signed,
        where it signed it), else one line saying why it is not. Whether rows are missing
        from its run is `audit`'s question."""
        if not rec.raw or parse_record(rec.raw) != rec:
            return "record does not match its stored row"
        return self._check(rec, self._run_row(rec.run_id))[0]

    def audit(self, run_id: int) -> Audit:
        """Check a run as a whole: its record, each row, and that its signed evaluations are
        exactly 1..count in a chain (nothing deleted, duplicated, reordered or moved in)."""
        run = self._run_row(run_id)
        reasons: dict[int, str | None] = {}
        signed: list[Record] = []
        for rec in self.candidates(run_id):
            why, mac_ok = self._check(rec, run)
            reasons[rec.id] = why
            if mac_ok:
                signed.append(rec)
        problem = self._record_problem(run) or sequence_problem(signed, run.evals, run.head)
        return Audit(problem, reasons, () if problem else tuple(signed))

    # --- runs and candidates ------------------------------------------------------------------
    def start_run(self, task: str, proposer: str, budget: int, options: dict) -> int:
        self.key()  # fail before writing when the key is missing: no unsigned runs
        try:
            cur = self.db.execute(
                "INSERT INTO runs (task, proposer, budget, created, options, nonce, evals)"
                " VALUES (?,?,?,?,?,?,0)",
                (task, proposer, budget, time.time(), json.dumps(options), secrets.token_hex(16)),
            )
            self._sign_run(int(cur.lastrowid))
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return int(cur.lastrowid)

    def resumable(self, task: str, proposer: str) -> int | None:
        """The latest unfinished run of (task, proposer) in this format (an older-format run
        cannot be extended: its rows are not bound to their positions)."""
        row = self.db.execute(
            "SELECT id FROM runs WHERE task=? AND proposer=? AND finished IS NULL "
            "AND nonce IS NOT NULL ORDER BY id DESC LIMIT 1", (task, proposer)).fetchone()  # fmt: skip
        return int(row[0]) if row else None

    def _writable(self, run_id: int) -> RunRow:
        """The run's record, refusing one that does not verify: re-signing it would launder
        whatever was done to it."""
        run = self._run_row(run_id)
        why = self._record_problem(run)
        if why is None:
            return run
        if why.startswith(OLDER):
            raise LabError(f"run {run_id} cannot be continued: {why}; start a new run "
                           "(wanka lab run --new)")  # fmt: skip
        raise LabError(f"run {run_id} failed the integrity check: {why}; start a new run "
                       "(wanka lab run --new)")  # fmt: skip

    def _update_run(self, run_id: int, sql: str, args: tuple) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
            self._writable(run_id)
            self.db.execute(f"UPDATE runs SET {sql} WHERE id=?", (*args, run_id))
            self._sign_run(run_id)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    def set_budget(self, run_id: int, budget: int) -> None:
        self._update_run(run_id, "budget=?, finished=NULL", (budget,))

    def finish(self, run_id: int) -> None:
        self._update_run(run_id, "finished=?", (time.time(),))

    def add(self, run_id: int, source: str, config: dict | None, note: str, fb: Feedback, *,
            source_sha256: str) -> int:  # fmt: skip
        """Record one evaluation. source_sha256: computed by the caller from the exact string
        it passed to evaluate (never from anything the candidate's process reported)."""
        if sha256_text(source) != source_sha256:
            raise LabError("source_sha256 does not match the source being recorded")
        self.key()  # fail before writing when the key is missing: no unsigned rows
        try:
            self.db.execute("BEGIN IMMEDIATE")  # count, insert and re-sign as one
            run = self._writable(run_id)
            cur = self.db.execute(
                "INSERT INTO candidates (run_id, n, prev, created, source, config, note, status,"
                " correct, time_s, baseline_s, reference_s, speedup, feedback, source_sha256)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, run.evals + 1, run.head, time.time(), source,
                 json.dumps(config) if config is not None else None, note, fb.status,
                 int(fb.correct), fb.time_s, fb.baseline_s, fb.reference_s, fb.speedup,
                 json.dumps(fb.to_dict()), source_sha256),
            )  # fmt: skip
            cid = int(cur.lastrowid)
            self._sign(cid, run)  # same transaction: the row never exists unsigned
            self.db.execute(
                "UPDATE runs SET evals=?, head=? WHERE id=?", (run.evals + 1, cid, run_id)
            )
            self._sign_run(run_id)
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise
        return cid

    def set_held_out(self, cand_id: int, fb: Feedback) -> None:
        # Re-signing a row that does not verify would launder a forged one: refuse.
        why = self.verify(self.candidate(cand_id))
        if why:
            raise LabError(f"candidate {cand_id} failed the integrity check: {why}")
        rec = self.candidate(cand_id)
        try:
            self.db.execute(
                "UPDATE candidates SET held_out_ok=?, held_out_speedup=?, held_out=? WHERE id=?",
                (int(fb.correct), fb.speedup, json.dumps(fb.to_dict()), cand_id),
            )
            self._sign(cand_id, self._run_row(rec.run_id))
            self.db.commit()
        except BaseException:
            self.db.rollback()
            raise

    def run(self, run_id: int) -> Run:
        r = self._run_row(run_id)
        if r is None:
            raise KeyError(run_id)
        return Run(r.id, r.task, r.proposer, r.budget, r.created, r.finished, r.options)

    def runs(self, task: str | None = None) -> list[Run]:
        q, args = "SELECT id FROM runs", ()
        if task:
            q, args = q + " WHERE task=?", (task,)
        return [self.run(r[0]) for r in self.db.execute(q + " ORDER BY id", args).fetchall()]

    def candidates(self, run_id: int) -> list[Record]:
        rows = self.db.execute(
            f"SELECT {COLUMNS} FROM candidates WHERE run_id=? ORDER BY n, id", (run_id,)
        ).fetchall()
        return [parse_record(r) for r in rows]

    def candidate(self, cand_id: int) -> Record:
        row = self.db.execute(f"SELECT {COLUMNS} FROM candidates WHERE id=?", (cand_id,)).fetchone()
        if row is None:
            raise KeyError(cand_id)
        return parse_record(row)


def _same(a, b: str) -> bool:
    if not isinstance(a, str):
        return False
    # bytes: compare_digest refuses non-ASCII str, and a forged row may hold anything
    return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode("utf-8", "replace"))
