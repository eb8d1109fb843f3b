"""Where `wanka export` / `wanka import` write before their files replace --out's.

Each command writes into a staging folder of its own inside --out (same filesystem, so the
files move by rename): `.wanka-partial-PID-RANDOM`, flock()ed by its writer for as long as it
writes, so two commands writing the same --out never touch each other's files, and a folder
whose lock nobody holds is a killed command's leftovers (removed by the next command). Setting
up and the final move (old files out, new ones in) take a lock on --out itself: of two
commands, one moves its files in whole, and the other then replaces them whole or fails in
one line (its `recheck` of --out, which sees the first one's files, refuses). A failed write
leaves --out as it was; a --out folder the command created is removed again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

STAGING = ".wanka-partial"  # alone: the one staging folder of wanka before per-command ones
_STAGING_NAME = re.compile(re.escape(STAGING) + r"(-\d+-[0-9a-f]{8})?")


def is_staging(name: str) -> bool:
    """A staging folder's name: never counted as --out's own content, never replaced."""
    return _STAGING_NAME.fullmatch(name) is not None


@contextlib.contextmanager
def staged(out: Path, recheck: Callable[[], None] | None = None) -> Iterator[Path]:
    """A folder inside `out` to write into; once the body is done, `recheck()` (a ValueError:
    --out is no longer what may be replaced) runs, `out`'s old files are removed and the new
    ones renamed into place. A failure in the body leaves `out` as it was."""
    out = out.resolve()  # `--out .`: the folder itself, not a sibling named "."
    created = _missing_top(out)
    try:
        tmp, hold = _make_staging(out)
    except OSError as e:
        _remove_created(out, created)
        raise ValueError(cannot_write(out, e.strerror or str(e))) from None
    try:
        try:
            yield tmp
        except BaseException as e:
            reason = _write_failure(e, tmp)  # asked before the files go: a full disk is still full
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_created(out, created)
            if reason is None:
                raise
            raise ValueError(cannot_write(out, reason)) from None
        _move_in(out, tmp, recheck)
    finally:
        os.close(hold)


def cannot_write(out: Path, reason: str) -> str:
    """The one line for a failed write into --out, with what to do about it."""
    if reason.startswith((os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))):
        fix = "free space or choose another folder"
    elif reason.startswith(tuple(os.strerror(n) for n in (errno.EACCES, errno.EPERM, errno.EROFS))):
        fix = "make it writable or choose another folder"
    else:
        fix = "check that disk or choose another folder"
    return f"cannot write --out {out}: {reason}; {fix}"


def _write_failure(e: BaseException, tmp: Path) -> str | None:
    """Why writing failed (e.g. "No space left on device"), or None for what is no failed
    write: a ValueError (already its own one line), an interrupt, a bug."""
    if isinstance(e, ValueError | KeyboardInterrupt | SystemExit | GeneratorExit):
        return None
    from wanka.train.checkpoint import write_failure  # knows DCP's wrapped and zip-writer errors

    return write_failure(e, tmp)


def as_os_error(e: Exception) -> OSError | None:
    """An OSError for the I/O error a Rust writer (safetensors, tokenizers) raises as its own
    exception type ("... I/O error: No space left on device (os error 28)"); None for others."""
    text = str(e)
    if m := re.search(r"\(os error (\d+)\)", text):
        n = int(m.group(1))
        return OSError(n, os.strerror(n))
    if "I/O error" in text:
        return OSError(errno.EIO, " ".join(text.split())[:200])
    return None


def _missing_top(out: Path) -> Path | None:
    """The outermost folder of out's path that does not exist yet: what this command creates."""
    top = None
    for p in (out, *out.parents):
        if os.path.lexists(p):
            break
        top = p
    return top


def _remove_created(out: Path, top: Path | None) -> None:
    """Remove the folders this command created, up to `top`, while empty: never a folder the
    user had, never one another command has put its staging folder in meanwhile."""
    if top is None:
        return
    for p in (out, *out.parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == top:
            return


def _make_staging(out: Path) -> tuple[Path, int]:
    """A new staging folder in out, and the descriptor holding its lock (close to release)."""
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        _remove_stale(out)
        tmp = out / f"{STAGING}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        hold = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        with contextlib.suppress(OSError):  # no flock on this filesystem: others keep theirs
            fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return tmp, hold


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on the folder (its own inode: no lock file is left in --out)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):  # no flock on this filesystem: best effort, unlocked
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_stale(out: Path) -> None:
    """Remove the staging folders of killed commands: the old fixed name, or one whose lock
    nobody holds. One whose lock cannot be tested (no flock there) is left alone."""
    for p in out.iterdir():
        if not is_staging(p.name) or p.is_symlink() or not p.is_dir():
            continue
        if p.name == STAGING or not _held(p):
            shutil.rmtree(p, ignore_errors=True)


def _held(path: Path) -> bool:
    """Whether a live command holds this staging folder's lock (True when that is unknown)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:  # EWOULDBLOCK: held; anything else: cannot tell
        return True
    finally:
        os.close(fd)


def _move_in(out: Path, tmp: Path, recheck: Callable[[], None] | None) -> None:
    """Replace out's files with tmp's, under out's lock: whole, or (recheck refuses) not at all."""
    with _locked(out):
        if recheck is not None:
            try:
                recheck()
            except ValueError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise ValueError(f"--out {out} changed while this command ran: {e}") from None
        try:  # renames within one filesystem: the old files go only once the new ones are whole
            for old in out.iterdir():
                if not is_staging(old.name):
                    shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
            for f in tmp.iterdir():
                f.rename(out / f.name)
            tmp.rmdir()
        except OSError as e:
            raise ValueError(f"cannot replace the files in --out {out}: {e.strerror or e} (the "
                             f"new ones are in {tmp})") from None  # fmt: skip
