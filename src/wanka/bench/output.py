"""Where a benchmark's results go: checked before it runs (minutes of measurement must not end
in a write that was never going to work), written whole or not at all (a full disk must not
leave half a JSON where the previous results were)."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def check_out(out: Path, flag: str = "--out") -> None:
    """One line unless `out` can be written: not a folder, its folder made and writable."""
    if out.is_dir():
        raise ValueError(f"{flag} {out} is a directory: pass a file path, e.g. {flag} "
                         f"{out / 'result.json'}")  # fmt: skip
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {out}: cannot create its directory {out.parent} "
                         f"({e.strerror}): pass another {flag}") from None  # fmt: skip
    try:
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.probe"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {out}: cannot write in {out.parent} ({e.strerror}): pass "
                         f"another {flag}") from None  # fmt: skip


def write_out(out: Path, text: str) -> None:
    """`text` into `out`, atomically: on any failure the file is as it was, and the error is
    one line."""
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise ValueError(f"cannot write {out} ({e.strerror}): it is as it was; free space or "
                         "pass another --out, then run the benchmark again") from None  # fmt: skip


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM (timeout, Slurm, systemd) ends the bench through its `finally:` blocks, as
    Ctrl-C does: by default it killed the process and left a cluster testbed (network
    namespaces, links) up, which refused every later run."""

    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
