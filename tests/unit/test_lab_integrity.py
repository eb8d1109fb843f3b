"""History integrity and export re-verification: rows carry a source hash and an HMAC keyed
by a secret next to the DB, so a row forged or edited by someone who can write the SQLite
file (but not read the key) fails `Store.verify`, and `wanka lab export` refuses it. Export
also re-runs the held-out check before writing, and records provenance in the module."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import hmac
import importlib.util
import json
import os
import sqlite3
import stat
from datetime import datetime

import pytest
import torch

import wanka
from wanka import cli
from wanka.lab import report as report_mod
from wanka.lab import runner as runner_mod
from wanka.lab.evaluator import EvalConfig, Feedback
from wanka.lab.proposers.search import SearchProposer
from wanka.lab.report import best_per_task, export, format_report, read_provenance, report
from wanka.lab.runner import RunConfig, verify_held_out
from wanka.lab.store import Store, sha256_text
from wanka.lab.task import LabError, Shape, Task
from wanka.lab.tasks import get_task
from wanka.ops import registry

EVAL = EvalConfig(repeats=3)
TASK = dataclasses.replace(
    get_task("rmsnorm-cpu"),
    shapes=(Shape("a", {"N": 16, "D": 64}),), timing_shape=Shape("t", {"N": 512, "D": 256}),
    held_out=(Shape("h", {"N": 5, "D": 24}),), held_out_timing=Shape("ht", {"N": 300, "D": 200}),
)  # fmt: skip
SRC = TASK.baseline  # a correct candidate: the reference itself
# What the attacker wants exported: code that runs on import.
PAYLOAD = "import os\nos.environ['WANKA_PWNED'] = '1'\ndef kernel(x, weight, eps):\n    return x\n"


def fb(speedup: float, time_s: float = 1e-3) -> Feedback:
    return Feedback("correct", time_s=time_s, baseline_s=time_s * speedup, reference_s=time_s)


@pytest.fixture
def stored(tmp_path):
    """A history with one legitimately recorded, held-out-checked candidate (no evaluation:
    the verdicts are made up, the store does not care where they come from)."""
    store = Store(tmp_path / "h.sqlite")
    run = store.start_run("rmsnorm-cpu", "search", 1, {})
    cid = store.add(run, SRC, {"impl": "upcast"}, "note", fb(2.0), source_sha256=sha256_text(SRC))
    store.set_held_out(cid, fb(1.5))
    return store, run, cid


def forge(store: Store, run: int, source: str = PAYLOAD, mac: str | None = "ab" * 32) -> int:
    """A row written straight into the DB, as by an attacker with write access but no key."""
    db = sqlite3.connect(store.path)
    cur = db.execute(
        "INSERT INTO candidates (run_id, n, created, source, config, note, status, correct,"
        " time_s, baseline_s, reference_s, speedup, feedback, held_out_ok, held_out_speedup,"
        " source_sha256, mac) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (run, 9, 0.0, source, None, "", "correct", 1, 1e-4, 1e-2, 1e-2, 100.0,
         json.dumps(fb(100.0, 1e-4).to_dict()), 1, 90.0, sha256_text(source), mac),
    )  # fmt: skip
    db.commit()
    db.close()
    return int(cur.lastrowid)


def edit(store: Store, sql: str, *args) -> None:
    db = sqlite3.connect(store.path)
    db.execute(sql, args)
    db.commit()
    db.close()


def test_legit_record_verifies_and_exports_with_provenance(stored, tmp_path, monkeypatch):
    store, run, cid = stored
    rec = store.candidate(cid)
    assert store.verify(rec) is None
    assert rec.source_sha256 == hashlib.sha256(SRC.encode()).hexdigest() and rec.mac
    out = tmp_path / "exp" / "lab_rmsnorm.py"
    path = export(store, "rmsnorm-cpu", out, backend="labintegrity", eval_cfg=EVAL, task=TASK)
    text = path.read_text()
    tree = ast.parse(text)
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "PROVENANCE" for t in n.targets)]  # fmt: skip
    prov = ast.literal_eval(node.value)
    assert prov == read_provenance(path)
    assert prov["source_sha256"] == hashlib.sha256(SRC.encode()).hexdigest()
    assert (prov["task"], prov["op"], prov["run_id"], prov["candidate"], prov["evaluation"]) == (
        "rmsnorm-cpu", "rms_norm", run, cid, 1)  # fmt: skip
    assert prov["speedup"] == pytest.approx(2.0) and prov["time_s"] == pytest.approx(1e-3)
    assert prov["held_out_speedup_history"] == pytest.approx(1.5)
    assert prov["held_out_recheck"] == "passed" and prov["held_out_speedup_recheck"] > 0
    assert prov["db"] == str(store.path.resolve()) and prov["config"] == {"impl": "upcast"}
    assert prov["wanka_version"] == wanka.__version__
    assert datetime.fromisoformat(prov["exported_utc"]).utcoffset().total_seconds() == 0
    header = text.split(SRC.splitlines()[0])[0]
    assert prov["source_sha256"] in header and "re-check passed" in header
    assert SRC.rstrip("\n") in text  # the exact source that was hashed
    spec = importlib.util.spec_from_file_location("lab_integrity_export", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "labintegrity" in registry.backends("rms_norm")
    monkeypatch.setenv("WANKA_OPS_BACKEND", "rms_norm=labintegrity")
    x, w = torch.randn(7, 24), torch.rand(24)
    torch.testing.assert_close(
        registry.call("rms_norm", x, w, 1e-6), TASK.reference_fn()(x, w, 1e-6)
    )
    assert os.listdir(out.parent) == [out.name]  # no temporary file left behind


def test_forged_row_fails_verify_and_export_refuses(stored, tmp_path):
    store, run, cid = stored
    bad = forge(store, run)
    unsigned = forge(store, run, mac=None)
    assert store.verify(store.candidate(bad)).startswith("MAC mismatch")
    assert store.verify(store.candidate(unsigned)).startswith("missing MAC")
    out = tmp_path / "x.py"
    # the forged row claims the best speedup: the export stops instead of writing it
    with pytest.raises(LabError, match=f"candidate {bad} failed the integrity check: MAC "
                       "mismatch.*re-run it with wanka lab eval"):  # fmt: skip
        export(store, "rmsnorm-cpu", out, task=TASK)
    for c in (bad, unsigned):
        with pytest.raises(LabError, match=f"candidate {c} failed the integrity check"):
            export(store, "rmsnorm-cpu", out, candidate=c, task=TASK)
    assert not out.exists()
    # the report leaves them out of the verified results
    row = best_per_task(store)["rmsnorm-cpu"]
    assert row["verified"].id == cid and row["best"].id == cid and row["tampered"] == 2
    # and they can't be laundered by a later held-out check
    with pytest.raises(LabError, match="integrity"):
        store.set_held_out(bad, fb(100.0))


def test_source_edited_after_the_fact_is_refused(stored, tmp_path):
    store, _, cid = stored
    edit(store, "UPDATE candidates SET source = ? WHERE id=?", PAYLOAD, cid)
    assert store.verify(store.candidate(cid)).startswith("source hash mismatch")
    with pytest.raises(LabError, match="failed the integrity check: source hash mismatch"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", task=TASK)
    # with the hash updated too, the MAC gives it away
    edit(store, "UPDATE candidates SET source_sha256 = ? WHERE id=?", sha256_text(PAYLOAD), cid)
    assert store.verify(store.candidate(cid)).startswith("MAC mismatch")
    with pytest.raises(LabError, match="MAC mismatch"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", candidate=cid, task=TASK)
    assert not (tmp_path / "x.py").exists()


@pytest.mark.parametrize("sql", [
    "UPDATE candidates SET speedup = 50.0",
    "UPDATE candidates SET held_out_speedup = 40.0",
    "UPDATE candidates SET config = '{\"impl\": \"fused\"}'",
    "UPDATE runs SET task = 'rope-cpu'",
])  # fmt: skip
def test_edited_verdict_is_refused(stored, tmp_path, sql):
    store, _, cid = stored
    edit(store, sql)
    assert store.verify(store.candidate(cid)).startswith("MAC mismatch")
    name = "rope-cpu" if "runs" in sql else "rmsnorm-cpu"
    with pytest.raises(LabError, match="failed the integrity check"):
        export(store, name, tmp_path / "x.py", candidate=cid)


def test_failed_recheck_refuses_and_writes_nothing(stored, tmp_path, monkeypatch):
    store, _, cid = stored
    calls = []

    def incorrect(task, source, cfg, shapes=None, timing_shape=None, seed=None):
        calls.append((source, shapes, timing_shape))
        return Feedback("incorrect", "shape h (set 0): out: max abs error 0.5 over tolerance\nmore")

    monkeypatch.setattr(report_mod, "evaluate", incorrect)
    out = tmp_path / "exp" / "x.py"
    out.parent.mkdir()
    with pytest.raises(LabError, match="failed the held-out re-check: incorrect: shape h") as e:
        export(store, "rmsnorm-cpu", out, task=TASK)
    assert "\n" not in str(e.value)
    assert calls == [(SRC, TASK.held_out, TASK.held_out_timing)]
    assert not out.exists() and os.listdir(out.parent) == []


def test_untimeable_task_needs_no_recheck(stored, tmp_path, monkeypatch, capsys):
    store, _, cid = stored
    monkeypatch.setattr(Task, "unavailable", lambda self: "needs a CUDA GPU")
    monkeypatch.setattr(report_mod, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    with pytest.raises(
        LabError, match="cannot re-check candidate .*needs a CUDA GPU.*--no-recheck"
    ):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", task=TASK)
    path = export(store, "rmsnorm-cpu", tmp_path / "x.py", recheck=False, task=TASK)
    prov = read_provenance(path)
    assert (
        prov["held_out_recheck"].startswith("skipped") and prov["held_out_speedup_recheck"] is None
    )
    # the CLI: one line, with the re-check's outcome
    argv = [
        "lab",
        "export",
        "rmsnorm-cpu",
        "--db",
        str(store.path),
        "--out",
        str(tmp_path / "y.py"),
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot re-check" in err and len(err.splitlines()) == 1
    assert cli.main([*argv, "--no-recheck"]) == 0
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and f"candidate {cid}, held-out re-check skipped" in out


def test_policy_still_applies_without_recheck(tmp_path):
    store = Store(tmp_path / "h.sqlite")
    run = store.start_run("rmsnorm-cpu", "llm", 1, {})
    cid = store.add(run, PAYLOAD, None, "", fb(3.0), source_sha256=sha256_text(PAYLOAD))
    store.set_held_out(cid, fb(3.0))
    with pytest.raises(LabError, match="breaks the source policy"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", recheck=False, task=TASK)
    assert not (tmp_path / "x.py").exists()


def test_key_and_db_are_private_and_a_lost_key_is_not_replaced(stored, tmp_path):
    store, run, cid = stored
    key = tmp_path / "h.sqlite.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    key.unlink()
    fresh = Store(store.path)
    why = fresh.verify(fresh.candidate(cid))
    assert "key file" in why and "missing" in why and "restore" in why
    with pytest.raises(LabError, match="key file .* is missing"):
        fresh.add(run, SRC, None, "", fb(1.0), source_sha256=sha256_text(SRC))
    assert not key.exists() and len(fresh.candidates(run)) == 1  # nothing written or replaced
    # an overridden key path (tests, a key kept elsewhere)
    other = Store(tmp_path / "o.sqlite", key_path=tmp_path / "keys" / "o.key")
    (tmp_path / "keys").mkdir()
    r = other.start_run("rmsnorm-cpu", "search", 1, {})
    c = other.add(r, SRC, None, "", fb(1.0), source_sha256=sha256_text(SRC))
    assert (tmp_path / "keys" / "o.key").exists() and other.verify(other.candidate(c)) is None
    with pytest.raises(LabError, match="source_sha256 does not match"):
        other.add(r, SRC, None, "", fb(1.0), source_sha256=sha256_text(PAYLOAD))


OLD_SCHEMA = """
CREATE TABLE runs (id INTEGER PRIMARY KEY, task TEXT NOT NULL, proposer TEXT NOT NULL,
  budget INTEGER, created REAL, finished REAL, options TEXT);
CREATE TABLE candidates (id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id),
  n INTEGER, created REAL, source TEXT, config TEXT, note TEXT, status TEXT, correct INTEGER,
  time_s REAL, baseline_s REAL, reference_s REAL, speedup REAL, feedback TEXT,
  held_out_ok INTEGER, held_out_speedup REAL, held_out TEXT);
"""


def test_old_schema_is_migrated_and_old_rows_stay_readable(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO runs VALUES (1, 'rmsnorm-cpu', 'search', 2, 0.0, 1.0, '{}')")
    db.execute(
        "INSERT INTO candidates VALUES (1, 1, 1, 0.0, ?, '{\"impl\": \"upcast\"}', 'old', "
        "'correct', 1, 0.001, 0.002, 0.002, 2.0, ?, 1, 1.5, NULL)",
        (SRC, json.dumps(fb(2.0).to_dict())),
    )
    db.commit()
    db.close()
    store = Store(path)
    cols = {r[1] for r in store.db.execute("PRAGMA table_info(candidates)")}
    assert {"source_sha256", "mac"} <= cols
    (old,) = store.candidates(1)
    assert (old.source, old.config, old.speedup, old.held_out_speedup) == (
        SRC, {"impl": "upcast"}, 2.0, 1.5)  # fmt: skip
    assert old.mac is None and store.verify(old).startswith("unverifiable (older format")
    with pytest.raises(LabError, match="candidate 1 failed the integrity check: unverifiable "
                       "\\(older format: recorded before history integrity checks"):  # fmt: skip
        export(store, "rmsnorm-cpu", tmp_path / "x.py", task=TASK)
    # an older-format run is not extended (its rows are not bound to their positions)
    with pytest.raises(LabError, match="run 1 cannot be continued: unverifiable"):
        store.add(1, SRC, None, "", fb(1.2), source_sha256=sha256_text(SRC))
    # no MAC'd rows yet: the key is created on first use and a new run's rows verify
    run = store.start_run("rmsnorm-cpu", "search", 1, {})
    c = store.add(run, SRC, None, "", fb(1.2), source_sha256=sha256_text(SRC))
    assert store.verify(store.candidate(c)) is None and Store(path).candidates(1)[0] == old


def test_runner_never_rechecks_or_resigns_a_forged_row(stored, monkeypatch):
    store, run, cid = stored
    bad = forge(store, run)
    logs: list[str] = []
    seen = []
    monkeypatch.setattr(
        runner_mod, "evaluate", lambda task, src, *a, **k: seen.append(src) or fb(1.0)
    )
    ok = verify_held_out(TASK, store, store.candidates(run), RunConfig(budget=1), logs.append)
    assert ok and PAYLOAD not in seen  # the legit candidate had its held-out check already
    assert any(f"candidate {bad} skipped: failed the integrity check" in s for s in logs)
    assert store.verify(store.candidate(bad)).startswith("MAC mismatch")


# --- the rows of a run: position, count and run identity are signed too ------------------

SPEEDS = (1.0, 1.25, 0.97, 1.23)  # the attacker's history: the best is evaluation 2


def src(i: int) -> str:
    return SRC + f"# variant {i}\n"


@pytest.fixture
def four(tmp_path):
    """A finished run of four evaluations; evaluation 2 is the best and passed held-out."""
    store = Store(tmp_path / "h.sqlite")
    run = store.start_run("rmsnorm-cpu", "search", 4, {})
    ids = [store.add(run, src(i), {"i": i}, "", fb(s), source_sha256=sha256_text(src(i)))
           for i, s in enumerate(SPEEDS)]  # fmt: skip
    store.set_held_out(ids[1], fb(1.08))
    store.finish(run)
    return store, run, ids


def copy_row(store: Store, cand_id: int, **changes) -> int:
    """INSERT a copy of a row (every column but the id), as an attacker with write access."""
    db = sqlite3.connect(store.path)
    cols = [r[1] for r in db.execute("PRAGMA table_info(candidates)") if r[1] != "id"]
    row = dict(zip(cols, db.execute(f"SELECT {', '.join(cols)} FROM candidates WHERE id=?",
                                    (cand_id,)).fetchone(), strict=True))  # fmt: skip
    row.update(changes)
    cur = db.execute(f"INSERT INTO candidates ({', '.join(row)}) VALUES "
                     f"({', '.join('?' * len(row))})", tuple(row.values()))  # fmt: skip
    db.commit()
    db.close()
    return int(cur.lastrowid)


def test_deleted_first_row_and_a_copied_best_are_reported(four, tmp_path, capsys):
    """The attacker's reproduction: delete evaluation 1, insert a copy of the best row."""
    store, run, ids = four
    before = format_report(report(store, tasks=["rmsnorm-cpu"]))
    assert f"run {run} rmsnorm-cpu (search, 4/4): @1: 1.00x" in before
    edit(store, "DELETE FROM candidates WHERE id=?", ids[0])
    dup = copy_row(store, ids[1])
    assert store.verify(store.candidate(dup)).startswith("MAC mismatch")
    assert store.verify(store.candidate(ids[1])) is None  # the original is intact
    rep = report(store, tasks=["rmsnorm-cpu"])
    (r,) = rep["runs"]
    assert r["integrity"] and "evaluation 1 of 4" in r["integrity"]
    assert r["milestones"] == {} and r["best_so_far"] == []
    (b,) = rep["leaderboard"]
    assert b["integrity_failures"] == 1 and b["verified_candidate"] == ids[1]
    text = format_report(rep)
    assert "@1" not in text and "4/4): @" not in text
    (line,) = [x for x in text.splitlines() if x.startswith(f"run {run} ")]
    assert "failed the integrity check: evaluation 1 of 4 is missing" in line
    assert "1 records failed the integrity check" in text
    # the CLI says so too, in one line per finding, and exits 0
    assert cli.main(["lab", "report", "--db", str(store.path), "--png", ""]) == 0
    out = capsys.readouterr().out
    assert "evaluation 1 of 4 is missing" in out and "@1: 1.25x" not in out
    with pytest.raises(LabError, match=f"candidate {dup} failed the integrity check: MAC"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", candidate=dup, recheck=False, task=TASK)


def _other_run(store: Store) -> int:
    other = store.start_run("rmsnorm-cpu", "llm", 1, {})
    return store.add(other, src(9), None, "", fb(3.0), source_sha256=sha256_text(src(9)))


def _shared_key_db(store: Store, tmp_path) -> int:
    """A row signed by another history that uses the same key file, copied in."""
    twin = Store(tmp_path / "twin.sqlite", key_path=store.key_path)
    r = twin.start_run("rmsnorm-cpu", "search", 4, {})
    for i, s in enumerate(SPEEDS):
        twin.add(r, src(i), {"i": i}, "", fb(s * 3), source_sha256=sha256_text(src(i)))
    row = twin.db.execute("SELECT * FROM candidates WHERE n=1").fetchone()
    cols = [d[0] for d in twin.db.execute("SELECT * FROM candidates").description]
    twin.close()
    db = sqlite3.connect(store.path)
    vals = dict(zip(cols, row, strict=True))
    db.execute("DELETE FROM candidates WHERE n=1 AND run_id=?", (vals["run_id"],))
    db.execute(f"INSERT INTO candidates ({', '.join(vals)}) VALUES ({', '.join('?' * len(vals))})",
               tuple(vals.values()))  # fmt: skip
    db.commit()
    db.close()
    return vals["id"]


def _rollback(store: Store, tmp_path) -> None:
    """Rows deleted and the run's record put back as it was when it counted fewer rows."""
    run = store.runs()[0].id
    cols = [r[1] for r in store.db.execute("PRAGMA table_info(runs)")]
    old = store.db.execute("SELECT * FROM runs WHERE id=?", (run,)).fetchone()
    store.add(run, src(7), None, "", fb(0.5), source_sha256=sha256_text(src(7)))
    db = sqlite3.connect(store.path)
    db.execute(f"UPDATE runs SET {', '.join(f'{c}=?' for c in cols)} WHERE id=?", (*old, run))
    db.commit()
    db.close()


@pytest.mark.parametrize("case, run_problem, bad_rows", [
    ("delete middle", "evaluation 3 of 4 is missing", 0),
    ("delete last", "evaluation 4 of 4 is missing", 0),
    ("reorder", "evaluation 1 of 4 is missing", 2),
    ("move from another run", None, 1),
    ("from another history with the same key", "evaluation 1 of 4 is missing", 1),
    ("rollback of the run record", "beyond the 4 its record counts", 0),
    ("run record edited", "run record MAC mismatch", 0),
])  # fmt: skip
def test_row_deletion_reordering_and_moves_are_detected(four, tmp_path, case, run_problem,
                                                        bad_rows):  # fmt: skip
    store, run, ids = four
    if case == "delete middle":
        edit(store, "DELETE FROM candidates WHERE id=?", ids[2])
    elif case == "delete last":
        edit(store, "DELETE FROM candidates WHERE id=?", ids[3])
    elif case == "reorder":
        edit(store, "UPDATE candidates SET n = 3 - n WHERE id IN (?, ?)", ids[0], ids[1])
    elif case == "move from another run":
        moved = _other_run(store)
        edit(store, "UPDATE candidates SET run_id=?, n=5 WHERE id=?", run, moved)
    elif case == "from another history with the same key":
        _shared_key_db(store, tmp_path)
    elif case == "rollback of the run record":
        _rollback(store, tmp_path)
    elif case == "run record edited":
        edit(store, "UPDATE runs SET proposer='llm' WHERE id=?", run)
    audit = store.audit(run)
    if run_problem is None:
        assert audit.problem is None
    else:
        assert run_problem in audit.problem
    rows = store.candidates(run)
    bad = [r.id for r in rows if store.verify(r) is not None]
    assert len(bad) == bad_rows
    rep = report(store, tasks=["rmsnorm-cpu"])
    mine = [r for r in rep["runs"] if r["run"] == run][0]
    assert (mine["integrity"] is None) == (run_problem is None)
    text = format_report(rep)
    if run_problem is not None:
        (line,) = [x for x in text.splitlines() if x.startswith(f"run {run} ")]
        assert run_problem in line and "@" not in line
    total = sum(b["integrity_failures"] for b in rep["leaderboard"])
    if total:
        assert f"{total} records failed the integrity check" in text
    # nothing tampered is ever ranked
    for b in rep["leaderboard"]:
        assert b["candidate"] not in bad and b["verified_candidate"] not in bad


def test_a_tampered_run_is_not_continued(four):
    store, run, ids = four
    edit(store, "DELETE FROM candidates WHERE id=?", ids[3])
    with pytest.raises(LabError, match=f"run {run} failed the integrity check: evaluation 4"):
        runner_mod.run_task(TASK, SearchProposer(), store, RunConfig(budget=6, run_id=run),
                            log=lambda s: None)  # fmt: skip
    edit(store, "UPDATE runs SET evals = 3")  # an edited run record: never re-signed
    with pytest.raises(LabError, match="run record MAC mismatch"):
        store.add(run, SRC, None, "", fb(1.0), source_sha256=sha256_text(SRC))
    assert len(store.candidates(run)) == 3


def _v1_mac(key: bytes, rec: dict, task: str) -> str:
    """The MAC of the format before rows were bound to their run and position."""
    body = {k: rec[k] for k in ("run_id", "n", "source_sha256", "status", "time_s",
                                "baseline_s", "reference_s", "speedup", "held_out_speedup",
                                "config")}  # fmt: skip
    body.update(task=task, correct=bool(rec["correct"]), held_out_ok=bool(rec["held_out_ok"]))
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.new(key, canon.encode(), hashlib.sha256).hexdigest()


def test_older_format_history_is_unverifiable_not_a_crash(tmp_path, capsys):
    """A history signed by the previous format (per-row MAC without position binding, no
    signed run record) still opens and reports: its rows are "unverifiable (older format)"
    and left out; a new run in it works; the old run is not continued."""
    path = tmp_path / "old.sqlite"
    key = os.urandom(32)
    (tmp_path / "old.sqlite.key").write_bytes(key)
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.execute("ALTER TABLE candidates ADD COLUMN source_sha256 TEXT")
    db.execute("ALTER TABLE candidates ADD COLUMN mac TEXT")
    db.execute("INSERT INTO runs VALUES (1, 'rmsnorm-cpu', 'search', 2, 0.0, NULL, '{}')")
    for n, s in ((1, 1.0), (2, 1.25)):
        rec = {"run_id": 1, "n": n, "source_sha256": sha256_text(src(n)), "status": "correct",
               "correct": 1, "time_s": 1e-3, "baseline_s": 1e-3 * s, "reference_s": 1e-3,
               "speedup": s, "held_out_ok": 1, "held_out_speedup": s, "config": None}  # fmt: skip
        db.execute(
            "INSERT INTO candidates (run_id, n, created, source, note, status, correct, time_s,"
            " baseline_s, reference_s, speedup, feedback, held_out_ok, held_out_speedup,"
            " source_sha256, mac) VALUES (1,?,0.0,?,'','correct',1,?,?,?,?,?,1,?,?,?)",
            (n, src(n), 1e-3, 1e-3 * s, 1e-3, s, json.dumps(fb(s).to_dict()), s,
             rec["source_sha256"], _v1_mac(key, rec, "rmsnorm-cpu")),
        )  # fmt: skip
    db.commit()
    db.close()
    store = Store(path)
    for r in store.candidates(1):
        assert store.verify(r).startswith("unverifiable (older format")
    assert store.audit(1).problem.startswith("unverifiable (older format")
    rep = report(store, tasks=["rmsnorm-cpu"])
    text = format_report(rep)
    assert "2 records are unverifiable (older format)" in text
    assert "run 1 rmsnorm-cpu (search, 2/2, unfinished): unverifiable (older format" in text
    assert rep["leaderboard"][0]["verified_candidate"] is None
    assert cli.main(["lab", "report", "--db", str(path), "--png", ""]) == 0
    assert "unverifiable (older format" in capsys.readouterr().out
    with pytest.raises(LabError, match="unverifiable \\(older format"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", recheck=False, task=TASK)
    with pytest.raises(LabError, match="run 1 .*older format"):
        store.add(1, SRC, None, "", fb(1.0), source_sha256=sha256_text(SRC))
    # the old unfinished run is not resumed (it cannot be extended): a new run starts
    assert store.resumable("rmsnorm-cpu", "search") is None
    new = store.start_run("rmsnorm-cpu", "search", 1, {})
    c = store.add(new, SRC, None, "", fb(1.1), source_sha256=sha256_text(SRC))
    assert store.verify(store.candidate(c)) is None and store.audit(new).problem is None


# --- tampered column types ---------------------------------------------------------------


def test_a_non_numeric_column_is_tampering_not_a_crash(four, tmp_path, capsys):
    store, run, ids = four
    edit(store, "UPDATE candidates SET speedup='9.9x', held_out_ok=1 WHERE n=3")
    rec = store.candidate(ids[2])
    why = store.verify(rec)
    assert why.startswith("column speedup holds") and "\n" not in why
    rep = report(store, tasks=["rmsnorm-cpu"])
    (b,) = rep["leaderboard"]
    assert b["integrity_failures"] == 1 and b["verified_candidate"] == ids[1]
    assert "evaluation 3 of 4" in rep["runs"][0]["integrity"]
    assert cli.main(["lab", "report", "--db", str(store.path), "--png", ""]) == 0
    assert "1 records failed the integrity check" in capsys.readouterr().out
    # export goes on with the intact best; the tampered one is refused in one line
    path = export(store, "rmsnorm-cpu", tmp_path / "x.py", recheck=False, task=TASK)
    assert read_provenance(path)["candidate"] == ids[1]
    argv = ["lab", "export", "rmsnorm-cpu", "--db", str(store.path), "--no-recheck"]
    assert cli.main([*argv, "--out", str(tmp_path / "y.py")]) == 0
    assert f"candidate {ids[1]}" in capsys.readouterr().out
    assert cli.main([*argv, "--out", str(tmp_path / "z.py"), "--candidate", str(ids[2])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "column speedup holds" in err
    assert not (tmp_path / "z.py").exists()


@pytest.mark.parametrize("sql", [
    "UPDATE candidates SET time_s=X'00ff' WHERE n=2",
    "UPDATE candidates SET correct='yes' WHERE n=2",
    "UPDATE candidates SET held_out_ok=7 WHERE n=2",
    "UPDATE candidates SET n='two' WHERE n=2",
    "UPDATE candidates SET config='{not json' WHERE n=2",
    "UPDATE candidates SET source=X'ff' WHERE n=2",
    "UPDATE candidates SET source=CAST(X'ff' AS TEXT) WHERE n=2",
    "UPDATE candidates SET feedback=CAST(X'ff' AS TEXT), note=X'00' WHERE n=2",
    "UPDATE candidates SET speedup=9e999 WHERE n=2",
    "UPDATE candidates SET mac=5 WHERE n=2",
    "UPDATE runs SET options='{not json', created='yesterday'",
])  # fmt: skip
def test_other_odd_values_are_tampering_not_a_crash(four, tmp_path, sql):
    store, run, ids = four
    edit(store, sql)
    rep = report(store, tasks=["rmsnorm-cpu"])
    format_report(rep)
    (b,) = rep["leaderboard"]
    if "runs" in sql:  # the run's record is off; its rows are still its own, signed
        assert "run record: column created holds" in rep["runs"][0]["integrity"]
        assert b["integrity_failures"] == 0 and b["verified_candidate"] == ids[1]
        export(store, "rmsnorm-cpu", tmp_path / "x.py", recheck=False, task=TASK)
        return
    why = store.verify(store.candidate(ids[1]))
    assert why.startswith(("column", "MAC mismatch")) and "\n" not in why
    assert b["integrity_failures"] == 1 and b["verified_candidate"] is None
    with pytest.raises(LabError, match=f"candidate {ids[1]} failed the integrity check"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", candidate=ids[1], recheck=False,
               task=TASK)  # fmt: skip
