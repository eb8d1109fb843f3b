"""Start ranks through torchrun. `wanka train CONFIG --nproc N` re-executes itself as
`python -m torch.distributed.run ... -m wanka.cli train ...`; torchrun's multi-node rendezvous
flags pass through unchanged. A single local rank runs in-process (no launcher overhead)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

# torchrun flags we forward as given (multi-node rendezvous and friends).
RDZV_FLAGS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr",
              "master_port", "max_restarts")  # fmt: skip


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_env() -> None:
    """World of one, so the same code path (process group, meshes, FSDP) runs everywhere."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for k, v in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(k, v)


def torchrun_command(
    nproc: int, rdzv: dict[str, str | int | None], worker_args: list[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--local-ranks-filter=0"]  # fmt: skip
    given = {k: v for k, v in rdzv.items() if v is not None}
    if "nnodes" not in given and "rdzv_endpoint" not in given:
        given.setdefault("master_port", free_port())  # local job: avoid clashing on 29500
    for k, v in given.items():
        cmd.append(f"--{k.replace('_', '-')}={v}")
    return cmd + ["-m", "wanka.cli", *worker_args]


def launch(nproc: int, rdzv: dict[str, str | int | None], worker_args: list[str]) -> int:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(torchrun_command(nproc, rdzv, worker_args), env=env)
