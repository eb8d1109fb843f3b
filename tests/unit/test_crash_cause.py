"""A crashed rank's cause reaches the console (its last exception line and log path), a crash
that repeats identically is not retried, and drills or user errors never evict a node."""

import types

from wanka.resilience import rank_logs
from wanka.resilience.ledger import EvictionPolicy, FaultLedger
from wanka.resilience.supervisor import Outcome, Supervisor

TRACE = """2026-12-01 [rank1] ERROR train failed
Traceback (most recent call last):
  File "x.py", line 3, in f
    raise RuntimeError("boom")
RuntimeError: shape mismatch in layer 3
"""


def test_last_exception_of_this_attempt_only(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank1.log").write_text("Traceback (most recent call last):\nKeyError: 'old'\n")
    marks = rank_logs.offsets(tmp_path)  # an attempt starts here
    assert rank_logs.last_exception(tmp_path, 1, marks) is None  # the old one does not count
    with open(logs / "rank1.log", "a") as f:
        f.write(TRACE)
    assert rank_logs.last_exception(tmp_path, 1, marks) == "RuntimeError: shape mismatch in layer 3"
    assert rank_logs.last_exception(tmp_path, 7, marks) is None  # no log at all


def test_the_same_crash_twice_is_not_transient():
    first = Outcome("process_crash", rank=1, max_step=4, error="RuntimeError: boom")
    same = Outcome("process_crash", rank=1, max_step=4, error="RuntimeError: boom")
    later = Outcome("process_crash", rank=1, max_step=9, error="RuntimeError: boom")
    killed = Outcome("process_crash", rank=1, max_step=4, error=None)  # e.g. SIGKILL: no trace
    sup = types.SimpleNamespace(outcomes=[first, same])
    assert Supervisor._repeated(sup, same)
    sup.outcomes = [first, later]
    assert not Supervisor._repeated(sup, later)  # progress was made: transient
    sup.outcomes = [killed, killed]
    assert not Supervisor._repeated(sup, killed)


def test_the_jobs_own_code_failing_twice_at_one_step_is_not_transient():
    """A death in the user_code phase (a reward function) leaves no exception to compare:
    the same cause at the same step and rank twice is enough."""
    died = Outcome("user_code", rank=0, max_step=2, detail="rank 0 died in user_code of step 3")
    again = Outcome("user_code", rank=0, max_step=2, detail="rank 0 died in user_code of step 3")
    sup = types.SimpleNamespace(outcomes=[died, again])
    assert Supervisor._repeated(sup, again)
    # A hang is time over a learned limit: a slow but honest step may overrun twice.
    hung = Outcome("user_code", rank=0, max_step=2, detail="made no progress", limit_s=30.0)
    sup.outcomes = [hung, hung]
    assert not Supervisor._repeated(sup, hung)
    other = Outcome("user_code", rank=0, max_step=5)
    sup.outcomes = [died, other]
    assert not Supervisor._repeated(sup, other)  # progress was made
    crash = Outcome("process_crash", rank=0, max_step=2)
    sup.outcomes = [crash, crash]
    assert not Supervisor._repeated(sup, crash)


def test_injected_faults_and_user_errors_do_not_count_toward_eviction(tmp_path):
    ledger = FaultLedger(tmp_path / "faults.sqlite")
    policy = EvictionPolicy(max_faults=3, window_s=3600, same_cause=2)
    for _ in range(5):
        ledger.record("job", "n1", 0, "hang", 3, "drill stop", injected=True)
        ledger.record("job", "n1", 0, "user_error", 3, "bad config")
        ledger.record("job", "n1", 0, "user_code", 3, "rank 0 died in user_code of step 4")
    assert ledger.evaluate("n1", policy) is None
    ledger.record("job", "n1", 0, "hang", 3, "real hang")
    reason = ledger.evaluate("n1", policy)
    assert reason is None  # one real hang: below both rules
    ledger.record("job", "n1", 0, "hang", 4, "real hang again")
    assert ledger.evaluate("n1", policy) == "2 x hang within 3600 s"
    assert len(ledger.faults("n1")) == 17  # all kept for the record


def test_old_ledger_gains_the_injected_column(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE faults (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, "
               "job TEXT NOT NULL, node TEXT NOT NULL, rank INTEGER, cause TEXT NOT NULL, "
               "step INTEGER, detail TEXT NOT NULL DEFAULT '')")  # fmt: skip
    db.execute("INSERT INTO faults (time, job, node, cause) VALUES (1e12, 'j', 'n1', 'hang')")
    db.commit()
    db.close()
    ledger = FaultLedger(path)
    ledger.record("job", "n1", 0, "hang", injected=True)
    assert len(ledger.faults("n1")) == 2
