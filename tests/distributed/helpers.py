"""Spawn real gloo ranks (free port, one process each) and read back what a run logged."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
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


def _in_turn(sync_dir: str, calls: list[tuple]) -> None:
    rank = int(os.environ["RANK"])
    for i, (fn, *args) in enumerate(calls):
        # Rank 0 picks this call's port just before it starts its store there, and tells the
        # other ranks through a file; they wait for it, so none meets the store of the call
        # before (the same port for every call hung: a rank that left a process group early
        # reached the old store while rank 0 still held it).
        port_file = Path(sync_dir) / f"port{i}"
        if rank == 0:
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(str(free_port()))
            tmp.rename(port_file)
        deadline = time.monotonic() + 600
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 never started call {i} ({fn.__name__})")
            time.sleep(0.01)
        os.environ["MASTER_PORT"] = port_file.read_text()
        fn(*args)


def spawn_in_turn(world: int, *calls: tuple) -> None:
    """Run each call, a (fn, *args) tuple, on `world` ranks, one after another in the same ranks:
    one spawn (one torch import per rank) for them all; raises if any rank fails. For whole
    independent jobs, each of which starts its own process group and destroys it at its end,
    each on a port of its own. A resume belongs in a fresh spawn, as a restarted job would run."""
    with tempfile.TemporaryDirectory(prefix="spawn-in-turn-") as sync_dir:
        spawn(world, _in_turn, sync_dir, list(calls))


def spawn_jobs(world: int, *jobs: list[str]) -> None:
    """Whole independent `wanka train` jobs (their overrides) in turn on `world` ranks."""
    spawn_in_turn(world, *((train_job, overrides) for overrides in jobs))


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
