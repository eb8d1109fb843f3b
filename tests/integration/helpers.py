"""What the CLI tests share: running `wanka` as a user does, and the tiny supervised job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wanka(*args: str, timeout: int = 300, env: dict[str, str] | None = None
          ) -> subprocess.CompletedProcess:  # fmt: skip
    """`python -m wanka.cli ARGS` from the repository root, output captured as text; `env`
    adds to (or replaces entries of) this process's environment."""
    return subprocess.run([sys.executable, "-m", "wanka.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})  # fmt: skip


def small_job(tmp: Path, run: str, keep: int = 3) -> list[str]:
    """`wanka train` arguments for a 12-step, 2-rank demo job writing under tmp/run, with its
    own fault ledger and snapshot dir so parallel tests never share them."""
    sets = ["data.seq_len=64", "train.micro_batch_size=4", "train.steps=12", "train.warmup_steps=2",
            "model.index_topk=16", "train.eval_every=1000", "data.val_batches=1",
            "checkpoint.every=4", f"checkpoint.keep={keep}", "run.tensorboard=false",
            f'run.dir="{tmp / run}"', f'resilience.ledger="{tmp / "faults.sqlite"}"',
            f'resilience.snapshot_dir="{tmp / "shm"}"']  # fmt: skip
    return ["configs/demo.toml", "--nproc", "2", *sum((["--set", s] for s in sets), [])]
