"""Checkpoints with torch.distributed.checkpoint (DCP), optionally async.

Layout: RUN_DIR/checkpoints/step-00000100/ holding DCP files plus a COMPLETE marker that rank 0
writes (atomically) only after every rank's data and DCP's metadata are on disk. The marker is
also the manifest: size and SHA-256 of every file. Only marked checkpoints whose files still
match their manifest are ever loaded, so a crash mid-save, a truncated or a corrupted file
falls back to the previous valid checkpoint (the bad one is kept, flagged CORRUPT, never read,
pruned or overwritten: a new save of its step first renames it step-N.corrupt-<time>). DCP stores tensors by
fully-qualified name and global shape, so a checkpoint saved by N ranks loads on M ranks.

A save that cannot be written (disk full, I/O error) fails alike on every rank and leaves no
`.partial-` directory behind. A periodic save (`must_succeed=False`) then only logs and reports
it and the run goes on; the final and the last-gasp checkpoints raise CheckpointWriteError.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from wanka.distributed.compression import (
    load_reducer_states,
    reducer_states,
    reset_reducer_states,
)
from wanka.train.manifest import (  # noqa: F401  (write_manifest: wanka import, tests)
    CORRUPT,
    MARKER,
    RANK_LOCAL,
    hash_own_files,
    manifest_problem,
    write_manifest,
)
from wanka.train.manifest import named_step as _named_step

PARTIAL = ".partial-"
# Set to "fatal" (the drills' torchrun baseline does) and every failed save ends the job, as
# in a plain training script.
FAILURES_ENV = "WANKA_CHECKPOINT_FAILURES"
WARN_IN_A_ROW = 3  # failed saves in a row after which the log says what is at stake
FULL_BELOW = 1 << 20  # bytes free after a failed write: the disk was full
log = logging.getLogger("wanka.checkpoint")


class CheckpointWriteError(ValueError):
    """A checkpoint could not be written; raised alike on every rank, its partial directory
    already removed. A ValueError so that where it ends the job (the final or the last-gasp
    checkpoint) `wanka train` says why in one line (exit 2) and the supervisor does not retry:
    a restart cannot free a disk."""

    def __init__(self, step: int, root: Path, reason: str, t0: float) -> None:
        self.step, self.root, self.reason, self.t0, self.t1 = step, root, reason, t0, time.time()
        super().__init__(f"checkpoint of step {step} could not be written to {root}: {reason}; "
                         f"{advice(reason)} and run the same command again")  # fmt: skip


IN_THE_WAY = "is in the way of this save"


def advice(reason: str) -> str:
    """What to do about a failed write, from its one-line reason (write_failure's)."""
    if IN_THE_WAY in reason:
        return "fix its permissions or move it away" if "cannot be read" in reason else (
            "move or delete it")  # fmt: skip
    if reason.startswith((os.strerror(errno.EACCES), os.strerror(errno.EPERM),
                          os.strerror(errno.EROFS))):  # fmt: skip
        return "make that directory writable (or move run.dir)"
    if reason.startswith((os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))):
        return "free space there (or move run.dir)"
    return "check that disk (or move run.dir)"


def in_the_way(path: Path) -> str | None:
    """Why `path`, where a checkpoint is to be renamed into place, cannot be replaced: a file
    or a link (not a checkpoint of ours: never deleted), or a folder that cannot be read."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            what = "a symbolic link" if path.is_symlink() else "a file"
            return f"{path} is {what}, not a checkpoint folder, and {IN_THE_WAY}"
        why = unreadable(path) if path.is_dir() else None
    except OSError as e:  # its folder cannot be searched
        why = e.strerror or str(e)
    return f"{path} cannot be read ({why}) and {IN_THE_WAY}" if why else None


def unreadable(path: Path) -> str | None:
    """Why the checkpoint folder `path` cannot be looked into (e.g. "Permission denied"),
    None when it can."""
    try:
        os.listdir(path)
        os.stat(path / MARKER)
    except PermissionError as e:
        return e.strerror or str(e)
    except OSError:
        pass  # missing or odd: the manifest check says what
    return None


def _is_file(path: Path) -> bool:
    """Path.is_file(), False also where the folder cannot be searched (no permission)."""
    try:
        return path.is_file()
    except OSError:
        return False


def verify(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong (one line)."""
    return _check(path)[0]


def _check(path: Path, rank: int = 0, world: int = 1, checksums: bool = True
           ) -> tuple[str | None, bool]:  # fmt: skip
    """(what is wrong or None, whether it is damage): a checkpoint that cannot be read (no
    permission) is not damaged: it is skipped, never flagged CORRUPT. Checksums of this
    rank's share of the files (manifest.manifest_problem)."""
    if why := unreadable(path):
        return f"{path.name}: cannot be read ({why}); fix its permissions to use it", False
    try:
        return manifest_problem(path, rank, world, checksums), True
    except (ValueError, TypeError):  # a manifest entry of another shape
        return f"{path.name}: no readable manifest", True
    except OSError as e:  # no permission: skipped; an I/O error: damaged
        name = Path(e.filename or "").name or "a file"
        fix = "; fix its permissions to use it" if isinstance(e, PermissionError) else ""
        return (f"{path.name}: {name} cannot be read ({e.strerror or e}){fix}",
                not isinstance(e, PermissionError))  # fmt: skip


def _last_line(e: BaseException) -> str:
    """DCP wraps per-rank tracebacks; their last line names the actual problem."""
    text = [t for t in str(e).strip().splitlines() if t.strip()]
    return text[-1].strip()[:200] if text else type(e).__name__


def _causes(e: BaseException) -> Iterator[BaseException]:
    """e, what it was raised from, and each rank's exception inside a CheckpointException."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            todo += [f[0] for f in x.failures.values() if isinstance(f, tuple) and f]


def write_failure(e: BaseException, root: Path) -> str | None:
    """One line saying why a checkpoint could not be written (e.g. "No space left on device"),
    or None when `e` is not a failed write (a bug, which must surface as itself)."""
    for x in _causes(e):
        if isinstance(x, OSError):
            return x.strerror or str(x)
    if not (isinstance(e, CheckpointException) and e.args[:1] == ("write",)):
        return None
    # torch.save's zip writer turns ENOSPC into "unexpected pos N vs M": ask the disk. A failed
    # write leaves its partial files in place until we remove them, so a full disk is still full.
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if free is not None and free < FULL_BELOW:
        return f"{os.strerror(errno.ENOSPC)} ({free >> 10} KiB free; DCP: {_last_line(e)})"
    return _last_line(e)


def model_diff(saved: str, current: str) -> str:
    a, b = json.loads(saved), json.loads(current)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"model.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in keys[:4])


def same_model(saved: str | None, current: str | None) -> bool:
    """Equal model configs, where a field the saved config predates counts as its default
    (a checkpoint from before a new option keeps loading while that option is left alone)."""
    if saved is None or current is None:
        return saved == current
    import dataclasses

    from wanka.config.schema import ModelConfig

    a, b = json.loads(saved), json.loads(current)
    defaults = dataclasses.asdict(ModelConfig())
    return {**defaults, **a} == {**defaults, **b}


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def remove_partials(root: Path) -> list[Path]:
    """Remove the `.partial-` directories of saves that never finished (a hang or a kill mid-
    save). Only where no live writer can own one: at job start, under the run-directory lock
    (train/run_lock.py), and by rank 0 of an attempt the supervisor relaunched (before it
    saves anything: Checkpointer.clear_partials). Returns what was removed."""
    gone = []
    for p in sorted(root.glob(PARTIAL + "*")) if root.is_dir() else ():
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            gone.append(p)
    return gone


def relaunched() -> bool:
    """A rank of an attempt the supervisor relaunched after a fault (not the job's first)."""
    try:
        attempt = int(os.environ.get("WANKA_ATTEMPT", "1"))
    except ValueError:
        return False
    return os.environ.get("WANKA_SUPERVISED") == "1" and attempt > 1


def damaged_checkpoints(root: Path) -> list[Path]:
    """Checkpoints flagged CORRUPT (also those renamed aside), kept for inspection."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if _is_file(p / CORRUPT))


def set_aside(path: Path) -> Path:
    """Rename a flagged checkpoint out of the way of a new save of its step:
    step-00000100 -> step-00000100.corrupt-20250101-120304 (kept, still flagged)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    os.replace(path, target)
    return target


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if _named_step(p) is not None and p.is_dir()
             and _is_file(p / MARKER) and not _exists(p / CORRUPT)]  # fmt: skip
    return sorted(found, key=_named_step)


def _prune(path: Path) -> None:
    """Delete an old checkpoint: renamed out of the step-N names first, so that a kill during
    the delete leaves a `.partial-` folder (removed at the next start), never a step-N folder
    without its manifest (said at every start, never pruned)."""
    gone = path.with_name(f"{PARTIAL}pruned-{path.name}")
    try:
        os.replace(path, gone)
    except OSError:
        gone = path
    shutil.rmtree(gone, ignore_errors=True)


def unmarked_checkpoints(root: Path) -> list[Path]:
    """step-N folders without a manifest (COMPLETE): saves are renamed into place only once
    complete, so one of these lost its manifest (deleted) or was put there by hand."""
    if not root.is_dir():
        return []
    try:
        found = [p for p in root.glob("step-*") if _named_step(p) is not None and p.is_dir()
                 and not _exists(p / MARKER) and not _exists(p / CORRUPT)]  # fmt: skip
    except OSError:
        return []
    return sorted(found, key=_named_step)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:
        return True  # cannot tell: not taken for a sound checkpoint


def unreadable_checkpoints(root: Path) -> list[tuple[Path, str]]:
    """Checkpoint folders (step-N) that cannot be looked into, with why (e.g. "Permission
    denied"): neither loaded, pruned nor flagged; latest_valid() says it skips them."""
    if not root.is_dir():
        return []
    try:
        names = os.listdir(root)
    except PermissionError as e:
        return [(root, e.strerror or str(e))]
    except OSError:
        return []
    out = []
    for name in sorted(names):
        p = root / name
        if _named_step(p) is not None and p.is_dir() and (why := unreadable(p)):
            out.append((p, why))
    return out


def supersede(root: Path, loaded: Path) -> Path | None:
    """checkpoint.load started this run from `loaded`, not from its newest checkpoint: the
    newer ones (all of them when `loaded` is another run's) hold the history it abandons.
    They are moved, never deleted, into ROOT/superseded-STAMP/, so that a restart after a
    fault ('latest'), pruning to checkpoint.keep and new saves of the same steps follow the
    new history. Returns that folder, None when nothing was moved. Rank 0 only."""
    try:
        here = loaded.resolve().parent == root.resolve()
    except OSError:
        here = False
    from_step = Checkpointer.step_of(loaded)
    newer = [p for p in complete_checkpoints(root) if not here or _named_step(p) > from_step]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = root / f"superseded-{stamp}", 1
    while target.exists():
        n += 1
        target = root / f"superseded-{stamp}-{n}"
    target.mkdir()
    for p in newer:
        os.replace(p, target / p.name)
    return target


class Checkpointer:
    _checked: Path | None = None  # what latest_valid() / newest_sound() just checked in full

    def __init__(self, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 keep: int, async_save: bool, is_main: bool) -> None:  # fmt: skip
        self.root, self.model, self.optimizer = root, model, optimizer
        self.keep, self.async_save, self.is_main = keep, async_save, is_main
        self._pending: tuple[Any, Path, int, float, bool] | None = None
        self.skipped: list[str] = []  # damaged checkpoints latest_valid() passed over
        self.none_usable = 0  # latest_valid() found only damaged checkpoints: how many
        self.unreadable = 0  # ... and how many it could not read (permissions)
        self.last_save_seconds = 0.0
        self.failures: list[CheckpointWriteError] = []  # failed writes not yet report()ed
        self.failed_in_a_row = 0
        # Async saves run DCP's collectives in a background thread: they need their own process
        # group, or they interleave with training collectives on the default one and deadlock.
        self._async_group = (
            dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        )

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(
        self, step: int, train_state: dict[str, Any], must_succeed: bool = True
    ) -> Path | None:
        """Save (blocking, or staged and written in the background when async). Returns the
        checkpoint's path, or None when it could not be written and must_succeed is False (the
        failure is logged and kept for report()); else raises CheckpointWriteError. An async
        save's write fails later, in wait() or the next save(), under the same rule."""
        self.wait()  # a periodic save still being written: its failure never blocks this one
        must_succeed = must_succeed or os.environ.get(FAILURES_ENV) == "fatal"
        t0, p0 = time.time(), time.perf_counter()
        path = step_dir(self.root, step)
        # Written beside the final name and renamed into place when complete: a step saved
        # again (say, after a resume) never exposes a half-rewritten directory.
        partial = self.root / f"{PARTIAL}{path.name}"
        blocked = None
        if self.is_main:
            blocked = in_the_way(path)  # said before the write, not after it
            try:
                if partial.is_symlink() or (partial.exists() and not partial.is_dir()):
                    partial.unlink()  # wanka's own name: no one else's data
                elif partial.exists():
                    shutil.rmtree(partial)
            except OSError as e:  # said by every rank alike, below
                blocked = blocked or write_failure(e, self.root)
        if dist.is_initialized():
            dist.barrier()
        state = self._state()
        state["train"] = {"step": step, "rng": torch.get_rng_state(), **train_state}
        _, problem = self._attempt(self._save_rank_local, partial)
        problem = self._agree(problem or blocked)
        if problem is not None:
            self._failed(step, partial, problem, t0, must_succeed)
            return None
        if self.async_save:
            fut, problem = self._attempt(dcp.async_save, state, checkpoint_id=str(partial),
                                         process_group=self._async_group)  # fmt: skip
            problem = self._agree(problem)
            if problem is None:
                self._pending = (fut, partial, step, t0, must_succeed)
        else:
            _, problem = self._attempt(dcp.save, state, checkpoint_id=str(partial))
            problem = self._agree(problem) or self._finish(partial, step)
        self.last_save_seconds = time.perf_counter() - p0
        if problem is not None:
            self._failed(step, partial, problem, t0, must_succeed)
            return None
        return path

    def _save_rank_local(self, partial: Path) -> None:
        """What each rank alone holds and DCP would save once for all (it treats plain tensors
        as replicated): the gradient compressors' error feedback (and PowerSGD's step count),
        one small file per rank, covered by the manifest like DCP's files."""
        states = reducer_states(self.model)
        if not any(s.get("state") or s.get("kept") for s in states):
            return
        partial.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        buf = io.BytesIO()
        torch.save({"world": world, "reducers": states}, buf)
        # Written as bytes: a full disk is then an OSError (ENOSPC) that write_failure knows,
        # not torch.save's RuntimeError on one rank while the others wait.
        with open(partial / f"{RANK_LOCAL}{rank}.pt", "wb") as f:
            f.write(buf.getbuffer())

    def _load_rank_local(self, path: Path) -> None:
        """Restore this rank's error feedback if every rank can (same world, method, layout);
        else every rank starts from zero, as freshly built reducers do."""
        if not any("state" in s for s in reducer_states(self.model)):
            return  # no compression, or a stateless one (bf16)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        f = path / f"{RANK_LOCAL}{rank}.pt"
        try:
            saved = torch.load(f, map_location="cpu", weights_only=True) if f.is_file() else None
            ok = (saved is not None and saved.get("world") == world
                  and load_reducer_states(self.model, saved["reducers"]))  # fmt: skip
        except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError):
            ok = False
        everyone = [ok]
        if dist.is_initialized():
            everyone = [None] * world
            dist.all_gather_object(everyone, ok)
        if not all(everyone):
            reset_reducer_states(self.model)  # mixed residuals would desynchronise the ranks
            if rank == 0:
                log.warning("checkpoint %s: no gradient-compression state for this layout "
                            "(another world size, method or shape); error feedback starts at "
                            "zero", path.name)  # fmt: skip

    def wait(self) -> None:
        """Finish an async save; its failure raises only if that save had to succeed."""
        if self._pending is None:
            return
        fut, partial, step, t0, must_succeed = self._pending
        self._pending = None
        _, problem = self._attempt(fut.result)
        problem = self._agree(problem) or self._finish(partial, step)
        if problem is not None:
            self._failed(step, partial, problem, t0, must_succeed)

    def _attempt(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
        """Run one part of a save: (its result, None), or (None, why) if it could not write.
        Anything else (a bug) raises as itself."""
        try:
            return fn(*args, **kwargs), None
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            problem = write_failure(e, self.root)
            if problem is None:
                raise
            return None, problem

    def _agree(self, problem: str | None) -> str | None:
        """Every rank leaves a save with the same outcome. DCP already raises on every rank
        when one rank's write fails (its coordinator broadcasts the failure); this also covers
        our own steps, which only rank 0 performs."""
        if not dist.is_initialized():
            return problem
        seen: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, problem)
        return next((p for p in seen if p), None)

    def _finish(self, partial: Path, step: int) -> str | None:
        """Rank 0 adds the manifest and renames the checkpoint into place; returns the (agreed)
        reason if that failed, None when the checkpoint is complete."""
        if dist.is_initialized():
            dist.barrier()
        # Each rank hashes the files it wrote (in its page cache still), rank 0 the rest.
        rank, world = self._rank_world()
        try:
            mine: tuple[dict, str | None] = (hash_own_files(partial, rank, world), None)
        except OSError as e:
            mine = ({}, write_failure(e, self.root) or f"{partial.name}: {e}")
        everyone = [mine]
        if world > 1:
            everyone = [None] * world if self.is_main else None
            dist.gather_object(mine, everyone, dst=0)
        problem = None
        if self.is_main:
            problem = next((p for _, p in everyone if p), None)
            try:
                if problem is None:
                    write_manifest(partial, step, {k: v for h, _ in everyone for k, v in h.items()})
                    final = step_dir(self.root, step)
                    problem = in_the_way(final)  # a file (never deleted), or a folder that
                    # cannot be read
                    if problem is None and (final / CORRUPT).exists():  # never overwritten
                        aside = set_aside(final)
                        log.warning("checkpoint %s was flagged corrupt; moved to %s (kept for "
                                    "inspection) to save step %d", final, aside.name, step)  # fmt: skip
                    elif problem is None and final.exists():
                        shutil.rmtree(final)
                    if problem is None:
                        os.replace(partial, final)
            except OSError as e:
                problem = write_failure(e, self.root)
            if problem is None:
                for old in complete_checkpoints(self.root)[: -self.keep] if self.keep > 0 else []:
                    _prune(old)
        # The others wait here (a checkpoint phase), not in the next step.
        problem = self._agree(problem)
        if problem is None:
            if self.failed_in_a_row:
                log.warning("checkpoint of step %d written: saving works again after %d failed "
                            "save(s)", step, self.failed_in_a_row)  # fmt: skip
            self.failed_in_a_row = 0
        return problem

    def _failed(self, step: int, partial: Path, reason: str, t0: float, must_succeed: bool) -> None:
        """Remove what the failed save left (only its own .partial- directory: complete
        checkpoints are never touched), then raise or log."""
        if self.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        err = CheckpointWriteError(step, self.root, reason, t0)
        self.failures.append(err)
        self.failed_in_a_row += 1
        if must_succeed:
            raise err
        fix = advice(reason)
        log.error("checkpoint of step %d NOT written to %s: %s. Training goes on (in-memory "
                  "snapshots still cover crashed ranks); the next scheduled save tries again. "
                  "%s.", step, self.root, reason, fix[:1].upper() + fix[1:])  # fmt: skip
        if self.failed_in_a_row >= WARN_IN_A_ROW:
            # Going on is still right: stopping would throw away every step since the newest
            # checkpoint, which the snapshots now hold, and would not free the disk.
            newest = self.latest()
            log.error("%d checkpoint saves in a row have failed; the newest on disk is %s: a "
                      "lost machine now costs every step since, and the final checkpoint will "
                      "end the job if the disk is still full", self.failed_in_a_row,
                      newest.name if newest else "none")  # fmt: skip

    @contextmanager
    def report(self, event: Callable[..., None], node: str,
               span: dict | None = None) -> Iterator[None]:  # fmt: skip
        """Record the failed writes of the block as timeline faults (cause
        checkpoint_write_failed) on the way out, also when the block raises one. `event` is
        Runtime.event; `span`, the block's timeline span, gets the reason as its error."""
        try:
            yield
        finally:
            for e in self.failures:
                event("fault", e.t0, e.t1, cause="checkpoint_write_failed", rank=None,
                      node=node, detail=e.reason, step=e.step)  # fmt: skip
                if span is not None:
                    span["error"] = f"checkpoint of step {e.step} not written: {e.reason}"
            self.failures.clear()

    def holds(self, step: int) -> bool:
        """Whether a complete checkpoint of `step` exists (rank 0 looks; all ranks agree)."""
        box = [self.is_main and step_dir(self.root, step) in complete_checkpoints(self.root)]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def clear_partials(self) -> None:
        """Rank 0 of a relaunched attempt: remove the `.partial-` folders of saves the attempt
        before left unfinished (a rank killed mid-save). No writer is left: every rank of that
        attempt was ended before this one's ranks met, and the supervisor holding the run
        lock keeps every other job out."""
        for p in remove_partials(self.root):
            log.warning("removed %s: left by a checkpoint save that never finished", p)

    def latest(self) -> Path | None:
        done = complete_checkpoints(self.root)
        return done[-1] if done else None

    def latest_valid(self) -> Path | None:
        """Newest checkpoint whose files match their manifest; every rank checks its share of
        the files of each candidate (newest first), all agree. Bad ones are flagged CORRUPT
        (kept for inspection, never loaded) and logged one line each; when none is usable,
        say_none_usable() says so in one line instead."""
        names: list[str] = []
        problems: list[str] = []
        unusable: list[Path] = []
        if self.is_main:
            if relaunched():
                self.clear_partials()
            for path, why in unreadable_checkpoints(self.root):
                unusable.append(path)
                name = f"checkpoint {path.name}" if path != self.root else f"folder {path}"
                log.error("skipping %s: cannot be read (%s); fix its permissions to use it",
                          name, why)  # fmt: skip
            names = [str(p) for p in reversed(complete_checkpoints(self.root)) if p not in unusable]
            for path in unmarked_checkpoints(self.root):  # else passed over without a word
                log.error("skipping checkpoint %s: it has no %s manifest (a save writes it last, "
                          "so a file of it was deleted or it is not a finished save); kept",
                          path.name, MARKER)  # fmt: skip
        if dist.is_initialized():
            box = [names]
            dist.broadcast_object_list(box, src=0)
            names = box[0]
        found = None
        for name in names:
            path = Path(name)
            problem, damaged = self._check_together(path)
            if problem is None:
                found = name
                break
            if not self.is_main:
                continue
            if not damaged:  # unreadable (permissions): skipped, never flagged
                unusable.append(path)
                log.error("skipping checkpoint %s", problem)
                continue
            problems.append(problem)
            try:
                (path / CORRUPT).write_text(problem + "\n")
            except OSError as e:  # a read-only disk: skipped all the same, said once
                log.error("checkpoint %s could not be flagged corrupt (%s)", path.name,
                          e.strerror or e)  # fmt: skip
        if self.is_main:
            self.skipped += problems
            self.none_usable = 0 if found else len(damaged_checkpoints(self.root))
            self.unreadable = 0 if found else len(unusable)
            for problem in problems if found else ():  # else say_none_usable() has one line
                log.error("skipping checkpoint %s", problem)
        self._checked = Path(found) if found else None
        return self._checked

    def newest_sound(self, root: Path) -> Path | None:
        """The newest complete checkpoint under `root` (another run's: nothing is flagged or
        said there) whose files match their manifest, checked by all ranks together."""
        names = [str(p) for p in reversed(complete_checkpoints(root))] if self.is_main else []
        if dist.is_initialized():
            box = [names]
            dist.broadcast_object_list(box, src=0)
            names = box[0]
        for name in names:
            if self._check_together(Path(name))[0] is None:
                self._checked = Path(name)
                return self._checked
        return None

    @staticmethod
    def _what_is_wrong(path: Path, field: str, resuming: bool) -> str | None:
        """What makes `path` no checkpoint to load (one line), before its files are checked."""
        if not path.is_dir():
            return f"{field}: no checkpoint directory {path}: fix {field}"
        if why := unreadable(path):
            return (f"{field}: checkpoint {path} cannot be read ({why}): fix its permissions or "
                    f"point {field} at another checkpoint")  # fmt: skip
        if not (path / MARKER).is_file() and (path / "checkpoints").is_dir() and resuming:
            return (f"checkpoint.load={str(path)!r} is a run directory, not one of its "
                    f"checkpoints: point it at {path / 'checkpoints'}/step-N")  # fmt: skip
        if not (path / MARKER).is_file():
            return (f"{field}: checkpoint {path} is incomplete (no {MARKER} marker): "
                    + ("pick an earlier one or set checkpoint.load='none'" if resuming
                       else "point it at a complete checkpoint, or at its run directory"))  # fmt: skip
        return None

    def _rank_world(self) -> tuple[int, int]:
        if dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _check_together(self, path: Path, checksums: bool = True) -> tuple[str | None, bool]:
        """_check() of `path` with the files shared round-robin over the ranks (a checksum
        of every file by every rank, or by rank 0 alone, took hours at 3.5 TB); one agreed
        answer, the first rank's problem."""
        rank, world = self._rank_world()
        mine = _check(path, rank, world, checksums)
        if world == 1:
            return mine
        seen: list[Any] = [None] * world
        dist.all_gather_object(seen, mine)
        return next((tuple(s) for s in seen if s[0]), (None, True))

    def say_none_usable(self, then: str = "starting from step 0") -> None:
        """Rank 0, after latest_valid() found checkpoints but every one damaged: one line,
        "no usable checkpoint in RUN_DIR/checkpoints (N damaged, kept for inspection);
        starting from step 0" (`then` says what the job does instead)."""
        if self.is_main and (self.none_usable or self.unreadable):
            what = [f"{self.none_usable} damaged"] * bool(self.none_usable)
            what += [f"{self.unreadable} unreadable"] * bool(self.unreadable)
            log.error("no usable checkpoint in %s (%s, kept for inspection); %s",
                      self.root, ", ".join(what), then)  # fmt: skip

    @staticmethod
    def step_of(path: Path) -> int:
        try:
            return int(json.loads((path / MARKER).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def load(self, path: Path, train_template: dict[str, Any], weights_only: bool = False,
             field: str = "checkpoint.load") -> dict[str, Any]:  # fmt: skip
        """Restore model + optimizer in place; return the saved train state. The template must
        hold every key the saved train state has (its values are replaced). weights_only: the
        model alone (checkpoint.init_weights): optimizer, RNG and the rest stay as built.
        `field`: the setting that named the checkpoint, which the errors point at."""
        resuming = not weights_only
        checked = path == self._checked  # latest_valid() just checked it in full
        # Agreed by every rank (the checks below are collective): a folder one rank sees gone
        # while the others do not must not leave those waiting in the checksums.
        if problem := self._agree(self._what_is_wrong(path, field, resuming)):
            if checked:  # the advice for a checkpoint the user named does not apply
                problem = (f"{field}: checkpoint {path} changed after it was checked (deleted "
                           "or rewritten meanwhile?); run the same command again")  # fmt: skip
            raise ValueError(problem)
        # The checkpoint latest_valid() just checked in full: its files' presence and sizes
        # again (it may have changed since), not their checksums.
        problem, _ = self._check_together(path, checksums=not checked)
        if problem is not None and checked:
            raise ValueError(f"{field}: checkpoint {problem}: it changed after it was checked "
                             "(deleted or rewritten meanwhile?); run the same command again")  # fmt: skip
        if problem is not None:
            raise ValueError(f"{field}: checkpoint {problem}: pick an earlier one"
                             + (", or 'latest' (which skips damaged checkpoints)" if resuming
                                else ", or its run directory (the newest sound one is taken)"))  # fmt: skip
        state = self._state()
        # Train-state keys newer than this checkpoint (e.g. lr_schedule) are skipped, not
        # required: DCP would refuse a key the checkpoint lacks. Nested dicts flatten to "a.b".
        saved_keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        template = _saved_part(train_template, "train", set(saved_keys))
        state["train"] = {"step": 0, "rng": torch.get_rng_state(), **template}
        # A model-only checkpoint (`wanka import` of a Hugging Face model): weights are loaded,
        # the optimizer starts fresh.
        with_optim = not weights_only and any(k.startswith("optim.") for k in saved_keys)
        if not with_optim:
            del state["optim"]
        fix = ("use the model config it was saved with, or a new run.dir" if resuming else
               "set this run's [model] to the one it was saved with")  # fmt: skip
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # missing keys / shape mismatches
            raise ValueError(f"{field}: checkpoint {path} does not fit this model "
                             f"({_last_line(e)}); {fix}") from None  # fmt: skip
        saved, now = state["train"].get("model_config"), train_template.get("model_config")
        if saved != now and not same_model(saved, now):
            raise ValueError(f"{field}: checkpoint {path} was saved with another [model] config "
                             f"({model_diff(saved, now)}): {fix}")  # fmt: skip
        if with_optim:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])  # fmt: skip
        else:
            set_model_state_dict(self.model, state["model"])
        if weights_only:
            return state["train"]
        torch.set_rng_state(state["train"]["rng"])
        self._load_rank_local(path)
        return state["train"]


class SaveSchedule:
    """When to write persistent checkpoints. every > 0: every N steps. every == 0: the
    Young/Daly optimum, T = sqrt(2 x C x MTBF) - C seconds of training between saves, where C
    is the measured cost of a save (slowest rank) and MTBF comes from the fault ledger (or
    checkpoint.mtbf_s); re-planned after every save, identically on every rank."""

    FIRST_AUTO_SAVE = 10  # an early save measures C

    def __init__(self, every: int, mtbf_s: float, start: int) -> None:
        self.every, self.mtbf_s = every, mtbf_s
        self.next = start + self.FIRST_AUTO_SAVE if every == 0 else None
        self.interval_steps: int | None = every or None

    def due(self, done_steps: int) -> bool:
        if self.every:
            return done_steps % self.every == 0
        return done_steps >= self.next

    def failed(self, done_steps: int) -> None:
        """A save that could not be written: the next one comes when it was planned anyway
        (at once would mostly fail again, at the cost of a save); with every > 0 that is the
        next multiple, else one interval (or the first-save distance) from now."""
        if not self.every:
            self.next = done_steps + (self.interval_steps or self.FIRST_AUTO_SAVE)

    def saved(self, done_steps: int, save_s: float, step_s: float) -> None:
        if self.every:
            return
        t = torch.tensor([save_s, step_s], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        cost, step_time = max(float(t[0]), 1e-3), max(float(t[1]), 1e-6)
        interval_s = max((2 * cost * self.mtbf_s) ** 0.5 - cost, cost)
        self.interval_steps = max(1, round(interval_s / step_time))
        self.next = done_steps + self.interval_steps


def _saved_part(template: dict, prefix: str, saved: set[str]) -> dict:
    """The entries of `template` a checkpoint holds, at every depth (DCP flattens nested
    dicts to "a.b.c"): a key added since (the loader's data size inside train.loader, say)
    is left out of what is loaded, not required, so older checkpoints still resume."""
    out = {}
    for k, v in template.items():
        name = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            part = _saved_part(v, name, saved)
            if part:
                out[k] = part
        elif name in saved or any(f.startswith(name + ".") for f in saved):
            out[k] = v
    return out
