"""Checkpoints with torch.distributed.checkpoint (DCP), optionally async.

Layout: RUN_DIR/checkpoints/step-00000100/ holding DCP files plus a COMPLETE marker that rank 0
writes only after every rank's data and DCP's metadata are on disk. Only marked checkpoints
are ever loaded, so a crash mid-save falls back to the previous one. DCP stores tensors by
fully-qualified name and global shape, so a checkpoint saved by N ranks loads on M ranks.
"""

from __future__ import annotations

import json
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
    found = [p for p in root.glob("step-*") if (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


class Checkpointer:
    def __init__(self, root: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 keep: int, async_save: bool, is_main: bool) -> None:  # fmt: skip
        self.root, self.model, self.optimizer = root, model, optimizer
        self.keep, self.async_save, self.is_main = keep, async_save, is_main
        self._pending: tuple[Any, Path, int] | None = None
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
        if self.is_main and path.exists():  # rewriting a step: it is not complete until done again
            (path / MARKER).unlink(missing_ok=True)
        if dist.is_initialized():
            dist.barrier()
        state = self._state()
        state["train"] = {"step": step, "rng": torch.get_rng_state(), **train_state}
        if self.async_save:
            fut = dcp.async_save(state, checkpoint_id=str(path), process_group=self._async_group)
            self._pending = (fut, path, step)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._finish(path, step)
        self.last_save_seconds = time.perf_counter() - t0
        return path

    def wait(self) -> None:
        if self._pending is None:
            return
        fut, path, step = self._pending
        self._pending = None
        fut.result()
        self._finish(path, step)

    def _finish(self, path: Path, step: int) -> None:
        if dist.is_initialized():
            dist.barrier()
        if self.is_main:
            (path / MARKER).write_text(json.dumps({"step": step, "time": time.time()}))
            for old in complete_checkpoints(self.root)[: -self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        done = complete_checkpoints(self.root)
        return done[-1] if done else None

    def load(self, path: Path, train_template: dict[str, Any]) -> dict[str, Any]:
        """Restore model + optimizer in place; return the saved train state. The template must
        hold every key the saved train state has (its values are replaced)."""
        if not path.is_dir():
            raise ValueError(f"no checkpoint directory {path}: fix checkpoint.load")
        if not (path / MARKER).is_file():
            raise ValueError(f"checkpoint {path} is incomplete (no {MARKER} marker): "
                             "pick an earlier one or set checkpoint.load='none'")  # fmt: skip
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
