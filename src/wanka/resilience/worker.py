"""What a rank adds to the training loop when it runs under the supervisor (or plain torchrun).

- progress: phase reports to the monitor (a no-op without one);
- stop requests: SIGTERM / SIGUSR1 set a flag; `stop_agreed()` all-reduces it at a step
  boundary so every rank stops at the same step and writes the last-gasp checkpoint;
- stacks: SIGUSR2 makes faulthandler write every thread's stack to the rank's log;
- the in-memory snapshot store, the loss guard and the injected faults of a drill;
- rank 0's timeline events (resilience/goodput.py) for the goodput account.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from wanka.config import JobConfig
from wanka.resilience.chaos import WorkerChaos
from wanka.resilience.heartbeat import NullReporter, Reporter

log = logging.getLogger("wanka.train")


class Preempted(Exception):
    """All ranks stopped on request after writing a checkpoint; the supervisor must not retry."""


class LossGuard:
    """Non-finite loss or gradient norm, or a loss above `spike_factor` x its running mean.
    The caller retries the step once (a transient fault leaves no trace) and skips the batch if
    it is bad again. Every rank sees the same global loss and norm, so all decide alike."""

    def __init__(self, spike_factor: float, warmup: int = 20) -> None:
        self.spike_factor, self.warmup = spike_factor, warmup
        self.mean, self.seen = 0.0, 0

    def check(self, loss: float, grad_norm: float) -> str | None:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return f"non-finite loss {loss} / grad norm {grad_norm}"
        if (
            self.spike_factor > 0
            and self.seen >= self.warmup
            and loss > self.spike_factor * self.mean
        ):
            return f"loss spike {loss:.4f} > {self.spike_factor} x mean {self.mean:.4f}"
        return None

    def accept(self, loss: float) -> None:
        self.seen += 1
        self.mean += (loss - self.mean) / min(self.seen, 50)  # running mean over ~50 steps

    def state_dict(self) -> dict:
        return {"mean": self.mean, "seen": self.seen}

    def load_state_dict(self, s: dict) -> None:
        self.mean, self.seen = s["mean"], s["seen"]


# Stop signals this rank received (supervisor._worker_entry reads it): one that came after the
# rank's last step boundary was never acted on, and the rank ends with it once its job is done.
STOP_SIGNALS: list[int] = []


class Runtime:
    def __init__(self, cfg: JobConfig, rank: int) -> None:
        env = os.environ
        self.cfg, self.rank = cfg, rank
        self.supervised = env.get("WANKA_SUPERVISED") == "1"
        # Under plain torchrun (the drills' baseline) the agent's restart count is the attempt.
        self.attempt = int(env.get("WANKA_ATTEMPT", env.get("TORCHELASTIC_RESTART_COUNT", "0")))
        self.job_id = env.get("WANKA_JOB_ID", "")
        self.node = env.get("WANKA_NODE") or os.uname().nodename
        self.launch_time = float(env.get("WANKA_LAUNCH_TIME", "0") or 0)
        hb = env.get("WANKA_HB_DIR")
        self.progress = Reporter(Path(hb), rank, self.attempt) if hb else NullReporter()
        run_dir = Path(cfg.run.dir)
        # Where an inside fault (nan, slow) marks that it fired: the run directory, or with the
        # control store the node's own folder, which its agent publishes (control/agent.py).
        marks = env.get("WANKA_CHAOS_MARKS") or run_dir / "resilience" / "chaos"
        self.chaos = WorkerChaos(env.get("WANKA_CHAOS", ""), rank, Path(marks))
        self.timeline = None
        if rank == 0 and (self.supervised or env.get("WANKA_TIMELINE") == "1"):
            from wanka.resilience.goodput import TimelineWriter

            self.timeline = TimelineWriter(run_dir / "resilience" / "timeline.jsonl", self.attempt)
        self.guard = LossGuard(cfg.resilience.spike_factor)
        self.skipped_in_a_row = 0
        self._stop = False
        if cfg.resilience.last_gasp:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._on_stop_signal)
        self._stack_file = None
        self._snapshots = None

    def _on_stop_signal(self, signum, frame) -> None:
        self._stop = True  # acted on at the next step boundary, by every rank together
        STOP_SIGNALS.append(signum)

    def enable_stack_dumps(self, log_path: Path) -> None:
        self._stack_file = open(log_path, "a")  # noqa: SIM115 - lives as long as the process
        faulthandler.register(signal.SIGUSR2, file=self._stack_file, all_threads=True)

    def stop_agreed(self) -> bool:
        flag = torch.tensor([float(self._stop)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def stop_before_step(self, step: int, span: dict) -> bool:
        """The check at the top of a step (inside its timeline span): every rank agrees whether
        a stop was asked for (SIGTERM/SIGUSR1 on any rank); if so the step span is marked not
        executed, so it is never counted as a kept step."""
        self.progress.enter("sync", step)
        stop = self.stop_agreed()
        if stop:
            span["error"] = "stopped before the step"
        return stop

    def span(self, kind: str, **extra):
        return self.timeline.span(kind, **extra) if self.timeline else nullcontext(extra)

    def event(self, kind: str, t0: float, t1: float | None = None, **extra) -> None:
        if self.timeline:
            self.timeline.event(kind, t0, t1, **extra)

    @contextmanager
    def phase(self, name: str, step: int | None = None):
        self.progress.enter(name, step)
        yield

    def snapshot_store(self, world: int, local_world: int, signature: str,
                       overlap: bool = False):  # fmt: skip
        """Only under the supervisor: it is what restores from them. `overlap` (the caller
        calls settle_snapshot before anything writes the state): copies run under the next
        step, else inside save()."""
        if not (self.supervised and self.cfg.resilience.snapshot_every > 0 and self.job_id):
            return None
        from wanka.resilience.snapshot import SnapshotStore

        r = self.cfg.resilience
        self._snapshots = SnapshotStore(Path(r.snapshot_dir), self.job_id, self.node, self.rank,
                                        world, local_world, r.snapshot_replica, signature,
                                        run_dir=Path(self.cfg.run.dir),
                                        overlap=overlap)  # fmt: skip
        return self._snapshots

    def settle_snapshot(self, step: int) -> None:
        """Before the optimizer writes the state: the snapshot copy still running under this
        step (resilience.snapshot_overlap) must be done; time waited for it is a stall."""
        store = self._snapshots
        if store is None:
            return
        if store.copying():  # a wait on it is the snapshot's, for the hang limits too
            self.progress.enter("snapshot", step)
        waited = store.settle()
        if waited > 0.0:
            now = time.time()
            self.event("snapshot", now - waited, now, step=step, waited=True)
