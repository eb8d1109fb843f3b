"""One `wanka train` run of `wanka bench comm`, as a user would start it, in a subprocess:
on the cluster-in-a-box (`--cluster`, one torchrun per node) or on this node (`--nproc`).
Reads back what the run's metrics file says; the bytes come from comm_counters."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from wanka.process_exit import end_with_parent

# Every run: nothing but training and the final evaluation, the same in runs of any length.
# No checkpoints, no mid-run evaluation, no in-memory snapshots (their replica goes to a rank
# on the other node: per-step link traffic that is not gradient reduction), no supervisor.
QUIET = {
    "checkpoint.enable": "false", "checkpoint.load": "none", "train.eval_every": "1000000000",
    "train.log_every": "1", "resilience.supervise": "false", "resilience.snapshot_every": "0",
    "resilience.preflight": "off", "run.tensorboard": "false", "parallel.dp_shard": "-1",
    "parallel.ep": "1",
}  # fmt: skip


class RunFailed(RuntimeError):
    """A `wanka train` run did not finish; the message is one line naming its log."""


def train_argv(config: str | None, sets: list[str], nproc: int,
               cluster_state: str | None) -> list[str]:  # fmt: skip
    where = ["--cluster", "--cluster-state", cluster_state] if cluster_state else []
    argv = [sys.executable, "-m", "wanka.cli", "train", *([config] if config else [])]
    return argv + ["--nproc", str(nproc), *where, *(x for s in sets for x in ("--set", s))]


def run_sets(shape: dict[str, str], steps: int, run_dir: Path, case_sets: list[str],
             user_sets: list[str]) -> list[str]:  # fmt: skip
    """The --set list of one run; later entries win, so the user's --set beats everything."""
    fixed = {**QUIET, **shape, "train.steps": str(steps), "run.dir": str(run_dir.resolve())}
    return [f"{k}={v}" for k, v in fixed.items()] + case_sets + user_sets


def _last_error(log: Path) -> str:
    """The line of a failed run's log that says why (wanka's own one-liner when there is one)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("wanka train:") or "Error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def run_train(argv: list[str], log: Path, timeout: float) -> float:
    """Run to completion, output to `log`; returns the wall time. A failure or a time-out
    stops the whole process group (the launcher and what it started) and raises RunFailed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(log, "w") as out:
        # Its own session (stopped as a group), ended with this process even by SIGKILL.
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True, preexec_fn=end_with_parent())  # fmt: skip
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if p.poll() is None:
                _stop_group(p)
    if rc != 0:
        why = f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}"
        raise RunFailed(f"{why}: {_last_error(log)} (log: {log})")
    return time.time() - t0


def _stop_group(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_metrics(run_dir: Path, warmup: int) -> dict:
    """The run's metrics.jsonl: rank 0's step times and tokens/s after the first `warmup`
    steps, the wall time each step's row was logged, and the last validation loss."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln]
    train = {int(r["step"]): r for r in rows if r.get("kind") == "train"}
    kept = [train[s] for s in sorted(train) if s > warmup]
    evals = [r["val_loss"] for r in rows if r.get("kind") == "eval"]
    return {
        "step_time_s": [r["step_time"] for r in kept],
        "tokens_per_s": [r["tokens_per_s"] for r in kept],
        "logged_at": {s: r["time"] for s, r in train.items()},
        "val_loss": evals[-1] if evals else None,
    }


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
