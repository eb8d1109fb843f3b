"""The lab history's records as Python values: the columns each signed row holds, and the
readers that turn a stored row into a Record / run row, tolerant of rows written outside
wanka lab (they load, and fail the store's checks with the column that is off).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field

from wanka.lab.verdict import Feedback

SIGNED = ("id", "run_id", "n", "prev", "created", "source", "config", "note", "status",
          "correct", "time_s", "baseline_s", "reference_s", "speedup", "feedback",
          "held_out_ok", "held_out_speedup", "held_out", "source_sha256")  # fmt: skip
COLUMNS = ", ".join((*SIGNED, "mac"))
RUN_SIGNED = ("id", "task", "proposer", "budget", "created", "finished", "options", "nonce",
              "evals", "head")  # fmt: skip
RUN_COLUMNS = ", ".join((*RUN_SIGNED, "mac"))
OLDER = "unverifiable (older format"  # how every reason about an older-format record starts


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
    prev: int | None = None  # id of the run's evaluation before this one (None: the first)
    malformed: str | None = None  # a column of the stored row that had the wrong type
    raw: tuple = field(default=(), repr=False, compare=False)  # the row as stored


@dataclass(frozen=True)
class Run:
    id: int
    task: str
    proposer: str
    budget: int
    created: float
    finished: float | None
    options: dict


@dataclass(frozen=True)
class Audit:
    """A run checked as a whole. problem: why its sequence of evaluations cannot be trusted
    (a record deleted, duplicated, reordered, moved or altered; its record edited; the older
    format), None when intact. reasons: per candidate id, why that row fails (None: intact).
    chain: the run's signed evaluations in order (empty when there is a problem)."""

    problem: str | None
    reasons: dict[int, str | None]
    chain: tuple[Record, ...] = ()

    @property
    def older(self) -> bool:
        return bool(self.problem and self.problem.startswith(OLDER))


@dataclass(frozen=True)
class RunRow:  # a run's record as stored, sanitised
    id: int
    task: str
    proposer: str
    budget: int | None
    created: float | None
    finished: float | None
    options: dict
    nonce: str | None
    evals: int  # how many evaluations the run holds
    head: int | None
    mac: str | None
    malformed: str | None
    raw: tuple


class BadText(bytes):
    """A TEXT value that is not valid UTF-8 (only an edit outside wanka lab stores one)."""


def decode_text(b: bytes):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return BadText(b)


def sequence_problem(signed: list[Record], count: int, head: int | None) -> str | None:
    """Why the rows whose MAC holds are not exactly the run's evaluations 1..count, each
    following the one before (None when they are)."""
    at: dict[int, list[Record]] = defaultdict(list)
    for r in signed:
        at[r.n].append(r)
    for n in sorted(at):
        if len(at[n]) > 1:
            return f"evaluation {n} appears {len(at[n])} times"
        if not 1 <= n <= count:
            return (f"evaluation {n} is beyond the {count} its record counts (rows deleted and "
                    "the run record rolled back)")  # fmt: skip
    prev = None
    for n in range(1, count + 1):
        if n not in at:
            return (f"evaluation {n} of {count} is missing (deleted, or altered so that it "
                    "fails its check)")  # fmt: skip
        if at[n][0].prev != prev:
            return f"evaluation {n} does not follow evaluation {n - 1}"
        prev = at[n][0].id
    if head != prev:
        return "its last evaluation is not the one its record names"
    return None


def canon(v):
    if isinstance(v, bytes):  # a BLOB, or a TEXT value that is not UTF-8
        return {"bytes": v.hex(), "text": isinstance(v, BadText)}
    raise TypeError(f"unexpected {type(v).__name__} in a stored row")


def _show(v) -> str:
    kind = "text that is not UTF-8" if isinstance(v, BadText) else f"a {type(v).__name__}"
    return f"{kind} ({repr(v)[:40]})"


class _Types:
    """Reads a stored row's columns into the types the code expects, noting the first that
    is off (only an edit outside wanka lab stores one) instead of failing later on it."""

    def __init__(self, row: dict):
        self.row, self.bad = row, None

    def _off(self, name: str, want: str) -> None:
        if self.bad is None:
            self.bad = f"column {name} holds {_show(self.row[name])}, not {want}"

    def int(self, name: str, default=None, *, allowed=None, null: bool = True):
        v = self.row[name]
        if v is None and null:
            return None
        if isinstance(v, int) and not isinstance(v, bool) and (allowed is None or v in allowed):
            return v
        self._off(name, "an integer" if allowed is None else f"one of {sorted(allowed)}")
        return default

    def num(self, name: str):
        v = self.row[name]
        if v is None:
            return None
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        self._off(name, "a finite number")
        return None

    def str(self, name: str, default=None, *, null: bool = True):
        v = self.row[name]
        if isinstance(v, str) or (v is None and null):
            return v
        self._off(name, "text")
        return default

    def json(self, name: str):
        v = self.str(name)
        if v is None:
            return None
        try:
            return json.loads(v)
        except (ValueError, RecursionError):
            self._off(name, "JSON")
            return None


def parse_record(r) -> Record:
    # Tolerant of rows written outside wanka lab: they must still load (and fail `verify`,
    # with the column that is off) rather than break the report.
    row = dict(zip((*SIGNED, "mac"), r, strict=True))
    t = _Types(row)
    rec = {
        "id": t.int("id", 0), "run_id": t.int("run_id", 0, null=False),
        "n": t.int("n", 0, null=False), "prev": t.int("prev"), "source": t.str("source", "", null=False),
        "config": t.json("config"), "status": t.str("status", "?", null=False),
        "correct": bool(t.int("correct", 0, allowed={0, 1}, null=False)),
        "time_s": t.num("time_s"), "baseline_s": t.num("baseline_s"),
        "reference_s": t.num("reference_s"), "speedup": t.num("speedup"),
        "held_out_ok": t.int("held_out_ok", 0, allowed={0, 1}),
        "held_out_speedup": t.num("held_out_speedup"),
        "source_sha256": t.str("source_sha256"), "mac": t.str("mac"),
    }  # fmt: skip
    if rec["held_out_ok"] is not None:
        rec["held_out_ok"] = bool(rec["held_out_ok"])
    malformed = t.bad  # the signed columns above; the rest only need to be usable
    try:
        fb = Feedback.from_dict(json.loads(row["feedback"]))
        fb.summary()
    except Exception:  # noqa: BLE001  (whatever was stored there, the row must load)
        fb = Feedback("error", "unreadable feedback in the history")
    created = row["created"] if isinstance(row["created"], int | float) else 0.0
    note = row["note"] if isinstance(row["note"], str) else ""
    return Record(**rec, created=created, note=note, feedback=fb, malformed=malformed,
                  raw=tuple(r))  # fmt: skip


def parse_run_row(r) -> RunRow:
    row = dict(zip((*RUN_SIGNED, "mac"), r, strict=True))
    t = _Types(row)
    task, proposer = t.str("task", "?", null=False), t.str("proposer", "?", null=False)
    budget, created, finished = t.int("budget"), t.num("created"), t.num("finished")
    options = t.json("options")
    nonce, evals, head, mac = t.str("nonce"), t.int("evals", 0), t.int("head"), t.str("mac")
    return RunRow(
        id=t.int("id", 0), task=task, proposer=proposer, budget=budget, created=created,
        finished=finished, options=options if isinstance(options, dict) else {},
        nonce=nonce, evals=evals or 0, head=head, mac=mac, malformed=t.bad,
        raw=tuple(r),
    )  # fmt: skip
