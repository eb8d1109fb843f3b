"""Start ranks through torchrun. `wanka train CONFIG --nproc N` runs torchrun's launcher (in this
process) with `-m wanka.cli train ...` as the worker; torchrun's multi-node rendezvous flags pass
through unchanged. A single local rank runs in-process (no launcher overhead)."""

from __future__ import annotations

import argparse
import logging
import os
import socket

# torchrun flags we forward as given (multi-node rendezvous and friends).
RDZV_FLAGS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr",
              "master_port", "max_restarts")  # fmt: skip


def _count(flag: str, low: int):
    def parse(text: str) -> str:
        if not text.strip().isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {low}")
        return text.strip()

    parse.__name__ = flag
    return parse


def _nnodes(text: str) -> str:
    """torchrun's N or MIN:MAX, checked here: 0 or a bad range failed deep inside (a traceback)."""
    parts = text.strip().split(":")
    if (
        len(parts) > 2
        or not all(p.isdigit() and int(p) >= 1 for p in parts)
        or (len(parts) == 2 and int(parts[0]) > int(parts[1]))
    ):
        raise argparse.ArgumentTypeError(f"{text!r}: want a host count N >= 1, or MIN:MAX with "
                                         "1 <= MIN <= MAX (elastic)")  # fmt: skip
    return text.strip()


def _port(text: str) -> str:
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return text.strip()


_port.__name__ = "master_port"


def rdzv_flag_type(flag: str):
    """The argparse type of one of RDZV_FLAGS: counts and the port are checked here (not by
    torchrun's own 19-line usage), the rest pass as text."""
    return {"nnodes": _nnodes, "node_rank": _count("node_rank", 0), "master_port": _port,
            "max_restarts": _count("max_restarts", 0)}.get(flag, str)  # fmt: skip


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


def torchrun_args(
    nproc: int, rdzv: dict[str, str | int | None], worker_args: list[str]
) -> list[str]:
    """torchrun's own argument list (what follows `torchrun` on a command line)."""
    cmd = [f"--nproc-per-node={nproc}", "--local-ranks-filter=0"]
    given = {k: v for k, v in rdzv.items() if v is not None}
    if "nnodes" not in given and "rdzv_endpoint" not in given:
        given.setdefault("master_port", free_port())  # local job: avoid clashing on 29500
    for k, v in given.items():
        cmd.append(f"--{k.replace('_', '-')}={v}")
    return cmd + ["-m", "wanka.cli", *worker_args]


def launch(nproc: int, rdzv: dict[str, str | int | None], worker_args: list[str]) -> int:
    """Run torchrun in this process and return the ranks' exit code (the first non-zero one).

    In-process rather than a subprocess so that a failing rank ends with its own one-line
    message (rank 0's output is shown) instead of torchrun's multi-screen failure report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet_launcher_logs()
    try:
        run(parse_args(torchrun_args(nproc, rdzv, worker_args)))
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        return next((c for c in codes if c > 0), 1)
    return 0


def quiet_launcher_logs() -> None:
    """torchrun's and the elastic agent's notices (the OMP_NUM_THREADS banner, "Received 15
    death signal") are not the user's business: wanka reports faults in its own one line.
    Their loggers set their own levels, so each existing one is lowered, not just the parent."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.run", "torch.multiprocessing")
    for name in [*logging.root.manager.loggerDict, *prefixes]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)
