"""SQLite history of every candidate: source, configuration, feedback, timings, verdict,
and the held-out check. A run is (task, proposer, budget); an unfinished run is picked up
again by the next `wanka lab run` for the same task and proposer (resumable)."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from wanka.lab.evaluator import Feedback

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
  id INTEGER PRIMARY KEY, task TEXT NOT NULL, proposer TEXT NOT NULL, budget INTEGER,
  created REAL, finished REAL, options TEXT);
CREATE TABLE IF NOT EXISTS candidates (
  id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id), n INTEGER,
  created REAL, source TEXT, config TEXT, note TEXT, status TEXT, correct INTEGER,
  time_s REAL, baseline_s REAL, reference_s REAL, speedup REAL, feedback TEXT,
  held_out_ok INTEGER, held_out_speedup REAL, held_out TEXT);
"""


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
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

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

    def add(self, run_id: int, source: str, config: dict | None, note: str, fb: Feedback) -> int:
        n = self.db.execute("SELECT COUNT(*) FROM candidates WHERE run_id=?", (run_id,)).fetchone()[
            0
        ]
        cur = self.db.execute(
            "INSERT INTO candidates (run_id, n, created, source, config, note, status, correct,"
            " time_s, baseline_s, reference_s, speedup, feedback) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run_id, n + 1, time.time(), source, json.dumps(config) if config is not None else None,
             note, fb.status, int(fb.correct), fb.time_s, fb.baseline_s, fb.reference_s,
             fb.speedup, json.dumps(fb.to_dict())),
        )  # fmt: skip
        self.db.commit()
        return int(cur.lastrowid)

    def set_held_out(self, cand_id: int, fb: Feedback) -> None:
        self.db.execute(
            "UPDATE candidates SET held_out_ok=?, held_out_speedup=?, held_out=? WHERE id=?",
            (int(fb.correct), fb.speedup, json.dumps(fb.to_dict()), cand_id),
        )
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
            "SELECT id, run_id, n, created, source, config, note, status, correct, time_s,"
            " baseline_s, reference_s, speedup, feedback, held_out_ok, held_out_speedup"
            " FROM candidates WHERE run_id=? ORDER BY n", (run_id,)).fetchall()  # fmt: skip
        return [_record(r) for r in rows]

    def candidate(self, cand_id: int) -> Record:
        row = self.db.execute(
            "SELECT id, run_id, n, created, source, config, note, status, correct, time_s,"
            " baseline_s, reference_s, speedup, feedback, held_out_ok, held_out_speedup"
            " FROM candidates WHERE id=?", (cand_id,)).fetchone()  # fmt: skip
        if row is None:
            raise KeyError(cand_id)
        return _record(row)


def _record(r) -> Record:
    return Record(
        id=r[0], run_id=r[1], n=r[2], created=r[3], source=r[4],
        config=json.loads(r[5]) if r[5] else None, note=r[6] or "", status=r[7],
        correct=bool(r[8]), time_s=r[9], baseline_s=r[10], reference_s=r[11], speedup=r[12],
        feedback=Feedback.from_dict(json.loads(r[13])),
        held_out_ok=None if r[14] is None else bool(r[14]), held_out_speedup=r[15],
    )  # fmt: skip
