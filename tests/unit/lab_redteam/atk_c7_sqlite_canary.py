"""Class 7: the audit hook sees Python-level `open` only. sqlite3 opens and writes files in
C, so the candidate creates a database where it was told a canary belongs (a real attacker
would pick the lab's history or the project). Success: the canary file exists."""

import sqlite3

from wanka.lab.tasks.rmsnorm import reference

_db = sqlite3.connect("@CANARY_DIR@/sqlite_canary.db")
_db.execute("CREATE TABLE IF NOT EXISTS pwned (what TEXT)")
_db.execute("INSERT INTO pwned VALUES ('written from inside the candidate')")
_db.commit()
_db.close()


def kernel(x, weight, eps):
    return reference(x, weight, eps)
