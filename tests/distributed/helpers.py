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


def small_job(dataset, run_dir, *extra: str) -> list[str]:
    """Overrides for a small, fast job on `dataset` writing to run_dir; tests add their own."""
    return [
        f'data.path="{dataset}"', "data.seq_len=96", "data.val_batches=1",
        "model.index_topk=16", "model.n_layers=3", "model.index_share_every=2",
        "train.steps=4", "train.warmup_steps=2", "train.eval_every=1000",
        "run.tensorboard=false", f'run.dir="{run_dir}"', *extra,
    ]  # fmt: skip


def _in_turn(calls: list[tuple]) -> None:
    for port, fn, *args in calls:
        os.environ["MASTER_PORT"] = str(port)
        fn(*args)


def spawn_in_turn(world: int, *calls: tuple) -> None:
    """Run each call, a (fn, *args) tuple, on `world` ranks, one after another in the same ranks:
    one spawn (one torch import per rank) for them all; raises if any rank fails. For whole
    independent jobs, each of which starts its own process group and destroys it at its end:
    each gets a port of its own, so a rank that left one job early never meets the store of the
    job before. A resume belongs in a fresh spawn, as a restarted job would run."""
    ports: list[int] = []
    while len(ports) < len(calls):
        if (port := free_port()) not in ports:
            ports.append(port)
    spawn(world, _in_turn, [(port, *call) for port, call in zip(ports, calls)])


def spawn_jobs(world: int, *jobs: list[str]) -> None:
    """Whole independent `wanka train` jobs (their overrides) in turn on `world` ranks."""
    spawn_in_turn(world, *((train_job, overrides) for overrides in jobs))


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
