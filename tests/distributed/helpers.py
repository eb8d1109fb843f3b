"""Spawn real gloo ranks (free port, one process each) and read back what a run logged."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    import torch

    torch.set_num_threads(1)
    fn(*args)


def spawn(world: int, fn, *args) -> None:
    """Run fn(*args) on `world` ranks; raises if any rank fails."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def train_job(overrides: list[str]) -> None:
    """A whole `wanka train` job on this rank (module-level so spawn can pickle it)."""
    from wanka.config import load_config
    from wanka.train.trainer import run

    run(load_config(None, overrides))


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
