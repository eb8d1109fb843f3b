"""Fault injection by step or time, per rank or node (torchft-style drills, real processes).

A schedule is `;`-separated faults, each `KIND@key=value,...`:
    kill@step=30,rank=1        SIGKILL one rank when it reaches step 30
    stop@step=60,rank=0        SIGSTOP one rank (a hang: the process lives, makes no progress)
    node_kill@step=90,node=1   SIGKILL every rank of node n1 and drop its shared memory
    fail_start@node=1,times=3  node n1's ranks crash at start-up, on the next 3 launches
    slow@step=40,rank=1,ms=300,steps=20   rank 1 sleeps 300 ms per step, for 20 steps
    nan@step=50,rank=1         rank 1's loss becomes NaN at step 50 (once)
    sigterm@step=120           SIGTERM to the job (preemption notice)
    corrupt_ckpt@step=70       flip bytes in the newest complete checkpoint
    truncate_ckpt@step=70      cut the newest complete checkpoint's largest file in half
`t=SECONDS` (since the job started) may replace `step=`. Each fault fires once, except
fail_start which fires on `times` consecutive starts. Faults outside a rank's control are
injected here, in the supervisor; the others (nan, slow, fail_start) travel to the ranks in
WANKA_CHAOS and fire inside them (resilience/worker.py).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from wanka.resilience.heartbeat import Beat

OUTSIDE = ("kill", "stop", "node_kill", "sigterm", "corrupt_ckpt", "truncate_ckpt")
INSIDE = ("nan", "slow", "fail_start")


@dataclass
class Fault:
    kind: str
    step: int | None = None
    t: float | None = None
    rank: int | None = None
    params: dict[str, int] = field(default_factory=dict)
    id: int = 0

    def spec(self) -> str:
        keys = {"step": self.step, "t": self.t, "rank": self.rank, **self.params}
        return self.kind + "@" + ",".join(f"{k}={v}" for k, v in keys.items() if v is not None)


def parse_schedule(text: str) -> list[Fault]:
    faults = []
    for i, item in enumerate(s.strip() for s in text.split(";")):
        if not item:
            continue
        kind, _, rest = item.partition("@")
        kind = kind.strip()
        if kind not in OUTSIDE + INSIDE:
            raise ValueError(f"chaos fault {item!r}: unknown kind {kind!r} "
                             f"(one of {', '.join(OUTSIDE + INSIDE)})")  # fmt: skip
        f = Fault(kind, id=i)
        for kv in filter(None, (x.strip() for x in rest.split(","))):
            k, eq, v = kv.partition("=")
            try:
                val = float(v) if k == "t" else int(v)
            except ValueError:
                raise ValueError(f"chaos fault {item!r}: {kv!r} must be key=number") from None
            if not eq:
                raise ValueError(f"chaos fault {item!r}: {kv!r} must be key=number")
            if k in ("step", "t", "rank"):
                setattr(f, k, val)
            else:
                f.params[k] = int(val)
        if kind != "fail_start" and f.step is None and f.t is None:
            raise ValueError(f"chaos fault {item!r}: say when, with step=N or t=SECONDS")
        if kind in ("kill", "stop", "nan", "slow") and f.rank is None:
            f.rank = 0
        faults.append(f)
    return faults


class ChaosDriver:
    """Fires the outside faults of a schedule while the supervisor polls heartbeats."""

    def __init__(self, faults: list[Fault], run_dir: Path, job: str, snapshot_root: str,
                 timeline, job_pid: int | None = None) -> None:  # fmt: skip
        self.faults, self.run_dir, self.job = faults, Path(run_dir), job
        self.job_pid = job_pid or os.getpid()
        self.snapshot_root, self.timeline = snapshot_root, timeline
        self.fired: dict[int, float] = {}  # fault id -> injection time
        self.fired_rank: dict[int, float] = {}  # rank -> last injection time hitting it
        self.sigterm_time: float | None = None
        self.t_start = time.time()
        self.marks = self.run_dir / "resilience" / "chaos"
        self.starts_left = {
            f.id: f.params.get("times", 1) for f in faults if f.kind == "fail_start"
        }
        self._collect_inside_marks()  # a resubmitted job must not replay faults that fired

    def worker_spec(self) -> str:
        """Inside faults not yet fired, for the ranks of the next attempt."""
        self._collect_inside_marks()
        todo = []
        for f in self.faults:
            if f.kind == "fail_start" and self.starts_left.get(f.id, 0) > 0:
                self.starts_left[f.id] -= 1
                self.fired[f.id] = time.time()
                todo.append(f)
            elif f.kind in ("nan", "slow") and f.id not in self.fired:
                todo.append(f)
        return ";".join(f"{f.spec()},id={f.id}" for f in todo)

    def _collect_inside_marks(self) -> None:
        for p in self.marks.glob("*.fired") if self.marks.is_dir() else ():
            fid = int(p.stem)
            if fid not in self.fired:
                self.fired[fid] = p.stat().st_mtime

    def fault_time(self, rank: int | None) -> float | None:
        return self.fired_rank.get(rank) if rank is not None else None

    def poll(self, beats: dict[int, Beat], now: float, attempt: int) -> None:
        if not beats:
            return
        step = max(b.step for b in beats.values())
        for f in self.faults:
            if f.kind not in OUTSIDE or f.id in self.fired:
                continue
            due = (f.step is not None and step >= f.step) or (
                f.t is not None and now - self.t_start >= f.t
            )
            if due and self._fire(f, beats):
                self.fired[f.id] = now
                self.marks.mkdir(parents=True, exist_ok=True)
                (self.marks / f"{f.id}.fired").touch()
                self.timeline.event("chaos", now, now, fault=f.spec(), attempt_no=attempt)

    def _fire(self, f: Fault, beats: dict[int, Beat]) -> bool:
        if f.kind in ("kill", "stop"):
            b = beats.get(f.rank)
            if b is None:
                return False
            os.kill(b.pid, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
            self.fired_rank[f.rank] = time.time()
        elif f.kind == "node_kill":
            from wanka.resilience.heartbeat import node_of
            from wanka.resilience.snapshot import drop_node

            hb = self.run_dir / "resilience" / "hb"
            node = f"n{f.params['node']}" if "node" in f.params else node_of(hb, 0)
            for b in beats.values():
                if node_of(hb, b.rank) not in (node, None):
                    continue
                try:
                    os.kill(b.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.fired_rank[b.rank] = time.time()
            drop_node(Path(self.snapshot_root), self.job, node)
        elif f.kind == "sigterm":
            self.sigterm_time = time.time()
            os.kill(self.job_pid, signal.SIGTERM)  # the job gets the notice; it reaches the ranks
        else:
            return damage_latest_checkpoint(self.run_dir / "checkpoints", f.kind)
        return True


def damage_latest_checkpoint(root: Path, kind: str) -> bool:
    from wanka.train.checkpoint import complete_checkpoints

    done = complete_checkpoints(root)
    if not done:
        return False
    files = sorted(
        (p for p in done[-1].iterdir() if p.suffix == ".distcp"), key=lambda p: -p.stat().st_size
    )
    if not files:
        return False
    target = files[0]
    data = bytearray(target.read_bytes())
    if kind == "truncate_ckpt":
        target.write_bytes(bytes(data[: len(data) // 2]))
    else:
        for i in range(0, len(data), max(len(data) // 64, 1)):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
    return True


class WorkerChaos:
    """The inside faults, as seen by one rank."""

    def __init__(self, spec: str, rank: int, marks: Path) -> None:
        self.rank, self.marks = rank, marks
        self.faults = []
        for item in filter(None, spec.split(";")):
            body, _, fid = item.rpartition(",id=")
            f = parse_schedule(body)[0]
            f.id = int(fid)
            self.faults.append(f)

    def _mark(self, f: Fault) -> None:
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / f"{f.id}.fired").touch()

    def at_start(self) -> None:
        node = os.environ.get("WANKA_NODE", "")
        if any(f.kind == "fail_start" and f.params.get("node") in (None, _node_index(node))
               for f in self.faults):  # fmt: skip
            raise SystemExit(f"chaos: node fails at start-up (rank {self.rank})")

    def nan_now(self, step: int) -> bool:
        for f in self.faults:
            if f.kind == "nan" and f.rank == self.rank and f.step == step:
                self.faults.remove(f)
                self._mark(f)
                return True
        return False

    def delay(self, step: int) -> float:
        for f in self.faults:
            if f.kind == "slow" and f.rank == self.rank and f.step is not None:
                if f.step <= step < f.step + f.params.get("steps", 10):
                    if step == f.step:
                        self._mark(f)
                    return f.params.get("ms", 200) / 1000
        return 0.0


def _node_index(name: str) -> int | None:
    """Cluster-in-a-box nodes are named n0, n1, ...; `node=1` in a schedule means n1."""
    return int(name[1:]) if name[:1] == "n" and name[1:].isdigit() else None
