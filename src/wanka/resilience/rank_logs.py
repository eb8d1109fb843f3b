"""What a failed rank said: the last exception in its RUN_DIR/logs/rankN.log, read only from
where the current attempt began, so the console can name the cause of a crash in one line."""

from __future__ import annotations

import re
from pathlib import Path

_TAIL_BYTES = 256 * 1024
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning|Failure)\b")


def log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank{rank}.log"


def offsets(run_dir: Path) -> dict[str, int]:
    """Current sizes of every rank log (taken when an attempt starts)."""
    folder = Path(run_dir) / "logs"
    return {p.name: p.stat().st_size for p in folder.glob("rank*.log")} if folder.is_dir() else {}


def last_exception(run_dir: Path, rank: int, since: dict[str, int] | None = None) -> str | None:
    """The final line of the last traceback rank `rank` logged after `since` (e.g.
    "ValueError: bad value"), or None when it logged none (killed, hung, or clean)."""
    path = log_path(run_dir, rank)
    try:
        with open(path, "rb") as f:
            start = max((since or {}).get(path.name, 0), f.seek(0, 2) - _TAIL_BYTES)
            f.seek(max(start, 0))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    tb = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")),
             default=None)  # fmt: skip
    if tb is None:
        return None
    for line in lines[tb + 1 :]:
        if line and not line[0].isspace() and _EXC_LINE.match(line):
            return line.strip()[:300]
    return None
