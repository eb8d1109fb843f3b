"""History integrity and export re-verification: rows carry a source hash and an HMAC keyed
by a secret next to the DB, so a row forged or edited by someone who can write the SQLite
file (but not read the key) fails `Store.verify`, and `wanka lab export` refuses it. Export
also re-runs the held-out check before writing, and records provenance in the module."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
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
from wanka.lab.report import best_per_task, export, read_provenance
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
    assert old.mac is None and store.verify(old).startswith("missing MAC")
    with pytest.raises(LabError, match="candidate 1 failed the integrity check: missing MAC"):
        export(store, "rmsnorm-cpu", tmp_path / "x.py", task=TASK)
    # no MAC'd rows yet: the key is created on first use and new rows verify
    c = store.add(1, SRC, None, "", fb(1.2), source_sha256=sha256_text(SRC))
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
