"""Checkpoints with torch.distributed.checkpoint (DCP), optionally async.

Layout: RUN_DIR/checkpoints/step-00000100/ holding DCP files plus a COMPLETE marker that rank 0
writes (atomically) only after every rank's data and DCP's metadata are on disk. The marker is
also the manifest: size and SHA-256 of every file. Only marked checkpoints whose files still
match their manifest are ever loaded, so a crash mid-save, a truncated or a corrupted file
falls back to the previous valid checkpoint (the bad one is kept, flagged CORRUPT, never read). DCP stores tensors by
fully-qualified name and global shape, so a checkpoint saved by N ranks loads on M ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MARKER = "COMPLETE"
CORRUPT = "CORRUPT"
log = logging.getLogger("wanka.checkpoint")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: Path, step: int) -> None:
    files = {p.name: [p.stat().st_size, _sha256(p)] for p in sorted(path.iterdir())
             if p.is_file() and p.name not in (MARKER, CORRUPT)}  # fmt: skip
    tmp = path / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({"step": step, "time": time.time(), "files": files}))
    os.replace(tmp, path / MARKER)


def verify(path: Path) -> str | None:
    """None if every file matches the manifest, else what is wrong (one line)."""
    try:
        manifest = json.loads((path / MARKER).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path.name}: no readable manifest"
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file():
            return f"{path.name}: {name} is missing"
        if f.stat().st_size != size:
            return f"{path.name}: {name} is {f.stat().st_size} bytes, manifest says {size} (truncated?)"
        if _sha256(f) != digest:
            return f"{path.name}: {name} does not match its checksum (corrupted)"
    return None


def _last_line(e: BaseException) -> str:
    """DCP wraps per-rank tracebacks; their last line names the actual problem."""
    text = [t for t in str(e).strip().splitlines() if t.strip()]
    return text[-1].strip()[:200] if text else type(e).__name__


def _diff(saved: str, current: str) -> str:
    a, b = json.loads(saved), json.loads(current)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"model.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in keys[:4])


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [
        p for p in root.glob("step-*") if (p / MARKER).is_file() and not (p / CORRUPT).exists()
    ]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


class Checkpointer:
    def __init__(self, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 keep: int, async_save: bool, is_main: bool) -> None:  # fmt: skip
        self.root, self.model, self.optimizer = root, model, optimizer
        self.keep, self.async_save, self.is_main = keep, async_save, is_main
        self._pending: tuple[Any, Path, int] | None = None
        self.skipped: list[str] = []  # damaged checkpoints latest_valid() passed over
        self.last_save_seconds = 0.0
        # Async saves run DCP's collectives in a background thread: they need their own process
        # group, or they interleave with training collectives on the default one and deadlock.
        self._async_group = (
            dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        )

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, step: int, train_state: dict[str, Any]) -> Path:
        """Save (blocking, or staged and written in the background when async)."""
        self.wait()
        t0 = time.perf_counter()
        path = step_dir(self.root, step)
        # Written beside the final name and renamed into place when complete: a step saved
        # again (say, after a resume) never exposes a half-rewritten directory.
        partial = self.root / f".partial-{path.name}"
        if self.is_main and partial.exists():
            shutil.rmtree(partial)
        if dist.is_initialized():
            dist.barrier()
        state = self._state()
        state["train"] = {"step": step, "rng": torch.get_rng_state(), **train_state}
        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._async_group)
            self._pending = (fut, partial, step)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._finish(partial, step)
        self.last_save_seconds = time.perf_counter() - t0
        return path

    def wait(self) -> None:
        if self._pending is None:
            return
        fut, path, step = self._pending
        self._pending = None
        fut.result()
        self._finish(path, step)

    def _finish(self, partial: Path, step: int) -> None:
        if dist.is_initialized():
            dist.barrier()
        if self.is_main:
            write_manifest(partial, step)
            final = step_dir(self.root, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial, final)
            for old in complete_checkpoints(self.root)[: -self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()  # the others wait here (a checkpoint phase), not in the next step

    def latest(self) -> Path | None:
        done = complete_checkpoints(self.root)
        return done[-1] if done else None

    def latest_valid(self) -> Path | None:
        """Newest checkpoint whose files match their manifest; rank 0 checks, all ranks agree.
        Bad ones are flagged CORRUPT (kept for inspection, never loaded)."""
        found = None
        if self.is_main:
            for path in reversed(complete_checkpoints(self.root)):
                problem = verify(path)
                if problem is None:
                    found = str(path)
                    break
                log.error("skipping checkpoint %s", problem)
                self.skipped.append(problem)
                (path / CORRUPT).write_text(problem + "\n")
        if dist.is_initialized():
            box = [found]
            dist.broadcast_object_list(box, src=0)
            found = box[0]
        return Path(found) if found else None

    @staticmethod
    def step_of(path: Path) -> int:
        try:
            return int(json.loads((path / MARKER).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def load(self, path: Path, train_template: dict[str, Any]) -> dict[str, Any]:
        """Restore model + optimizer in place; return the saved train state. The template must
        hold every key the saved train state has (its values are replaced)."""
        if not path.is_dir():
            raise ValueError(f"no checkpoint directory {path}: fix checkpoint.load")
        if not (path / MARKER).is_file():
            raise ValueError(f"checkpoint {path} is incomplete (no {MARKER} marker): "
                             "pick an earlier one or set checkpoint.load='none'")  # fmt: skip
        if (problem := verify(path)) is not None:
            raise ValueError(f"checkpoint {problem}: pick an earlier one, or 'latest' "
                             "(which skips damaged checkpoints)")  # fmt: skip
        state = self._state()
        state["train"] = {"step": 0, "rng": torch.get_rng_state(), **train_template}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # missing keys / shape mismatches
            raise ValueError(f"checkpoint {path} does not fit this model ({_last_line(e)}); "
                             "use the model config it was saved with, or a new run.dir") from None  # fmt: skip
        saved, now = state["train"].get("model_config"), train_template.get("model_config")
        if saved != now:
            raise ValueError(f"checkpoint {path} was saved with another [model] config "
                             f"({_diff(saved, now)}): restore those values or use a new run.dir")  # fmt: skip
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
        torch.set_rng_state(state["train"]["rng"])
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
