"""Fault injection by step or time, per rank or node (torchft-style drills, real processes).

A schedule is `;`-separated faults, each `KIND@key=value,...`:
    kill@step=30,rank=1        SIGKILL one rank when it reaches step 30
    stop@step=60,rank=0        SIGSTOP one rank (a hang: the process lives, makes no progress)
    node_kill@step=90,node=1   SIGKILL every rank of node n1 and drop its shared memory (on
                               the cluster-in-a-box: every process in n1, as a power loss)
    link_cut@t=300,node=1,for=20   cut node n1's link for 20 s (cluster-in-a-box jobs only)
    fail_start@node=1,times=3  node n1's ranks crash at start-up, on the next 3 launches
    slow@step=40,rank=1,ms=300,steps=20   rank 1 sleeps 300 ms per step, for 20 steps
    nan@step=50,rank=1         rank 1's loss becomes NaN at step 50 (once)
    sigterm@step=120           SIGTERM to the job (preemption notice)
    corrupt_ckpt@step=70       flip bytes in the newest complete checkpoint
    truncate_ckpt@step=70      cut the newest complete checkpoint's largest file in half
    disk_full@step=20,for=30   fill the checkpoint filesystem for 30 s (or steps=N: N steps);
                               keep_mb=M leaves M MiB free; max_gb=G raises the safety cap
`t=SECONDS` (since the job started) may replace `step=`. Each fault fires once, except
fail_start which fires on `times` consecutive starts. Faults outside a rank's control are
injected here, in the supervisor; the others (nan, slow, fail_start) travel to the ranks in
WANKA_CHAOS and fire inside them (resilience/worker.py).

disk_full fills the whole filesystem holding RUN_DIR/checkpoints with a ballast file, which
would starve every other process using it: it refuses a filesystem larger than a cap (4 GiB;
WANKA_CHAOS_FILL_MAX_GB or max_gb= raise it). Put the checkpoints on a small filesystem of
their own: `small_filesystem()` mounts a size-limited tmpfs there (root on Linux), as
`wanka chaos drill --ckpt-fs-mb N` does.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from wanka.resilience.heartbeat import Beat

OUTSIDE = ("kill", "stop", "node_kill", "link_cut", "sigterm", "corrupt_ckpt", "truncate_ckpt",
           "disk_full")  # fmt: skip
INSIDE = ("nan", "slow", "fail_start")
FLOAT_PARAMS = ("for", "max_gb")  # every other parameter is an integer
DISK_FULL_PARAMS = ("for", "steps", "keep_mb", "max_gb")
DISK_FULL_FOR_S = 30.0  # how long the disk stays full when neither for= nor steps= says
LINK_CUT_FOR_S = 30.0  # how long a cut link stays down when for= does not say
# After a node_kill (or the end of a link cut) a node-level fault of that node within this long
# is the injected fault's consequence (a restart that found the node still coming back).
NODE_FAULT_AFTER_S = 60.0
BALLAST = ".chaos-ballast"  # in RUN_DIR/checkpoints; never matches a checkpoint's name
FILL_CAP_ENV = "WANKA_CHAOS_FILL_MAX_GB"
FILL_CAP_GB = 4.0
MIB, GIB = 1 << 20, 1 << 30


@dataclass
class Fault:
    kind: str
    step: int | None = None
    t: float | None = None
    rank: int | None = None
    params: dict[str, float] = field(default_factory=dict)
    id: int = 0

    def spec(self) -> str:
        # `step` is the 0-based index of the step in progress (what heartbeats carry); the text
        # names steps 1-based, as the progress bar and the supervisor's messages do.
        step = None if self.step is None else self.step + 1
        keys = {"step": step, "t": self.t, "rank": self.rank, **self.params}
        # for=600 reads back as written, not as 600.0
        keys = {
            k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in keys.items()
        }
        return self.kind + "@" + ",".join(f"{k}={v}" for k, v in keys.items() if v is not None)


# The keys each kind takes (a typo must not pass silently: `rnak=1` would kill rank 0). nan and
# slow fire inside the ranks, at a step only.
KEYS = {
    "kill": ("step", "t", "rank"),
    "stop": ("step", "t", "rank"),
    "node_kill": ("step", "t", "node"),
    "link_cut": ("step", "t", "node", "for"),
    "fail_start": ("node", "times", "counted"),
    "slow": ("step", "rank", "ms", "steps"),
    "nan": ("step", "rank"),
    "sigterm": ("step", "t"),
    "corrupt_ckpt": ("step", "t"),
    "truncate_ckpt": ("step", "t"),
    "disk_full": ("step", "t", *DISK_FULL_PARAMS),
}
_SHOWN = {"step": "step=N", "t": "t=SECONDS", "rank": "rank=R", "node": "node=N",
          "for": "for=SECONDS", "times": "times=N", "ms": "ms=MS", "steps": "steps=N",
          "keep_mb": "keep_mb=MIB", "max_gb": "max_gb=GIB", "counted": "counted=1"}  # fmt: skip
POSITIVE = ("for", "times", "ms", "steps", "max_gb")  # > 0; every other value >= 0


def takes(kind: str) -> str:
    """The keys a fault kind takes, as the errors show them: "kill takes step=N, t=SECONDS,
    rank=R"."""
    return f"{kind} takes " + ", ".join(_SHOWN[k] for k in KEYS[kind])


def parse_schedule(text: str, world: int | None = None, nodes: int | None = None) -> list[Fault]:
    """--chaos's faults; `world` (the job's ranks, when known here) bounds their rank=, and
    `nodes` (its hosts) their node= (without it `world` does: a node runs one rank at least).
    A fault on a node the job lacks would never fire, and a drill would pass without it."""
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
        seen: set[str] = set()
        for kv in filter(None, (x.strip() for x in rest.split(","))):
            k, eq, v = (x.strip() for x in kv.partition("="))
            if not eq or not k:
                raise ValueError(f"chaos fault {item!r}: {kv!r} must be key=number ({takes(kind)})")
            if k not in KEYS[kind]:
                raise ValueError(f"chaos fault {item!r}: unknown parameter {k!r} ({takes(kind)})")
            if k in seen:
                raise ValueError(f"chaos fault {item!r}: {k}= given twice: give it once")
            seen.add(k)
            f_val = _number(item, kv, v, kind)
            if k == "t" or k in FLOAT_PARAMS:
                val = f_val
            elif f_val.is_integer():
                val = int(f_val)
            else:
                raise ValueError(f"chaos fault {item!r}: {kv!r}: {k} must be a whole number "
                                 f"({takes(kind)})")  # fmt: skip
            if k == "step":
                if val < 1:
                    raise ValueError(f"chaos fault {item!r}: steps count from 1 (step=1 is the "
                                     "first step)")  # fmt: skip
                f.step = val - 1  # "during step N" (1-based) = while N - 1 steps are done
            elif k in ("t", "rank"):
                setattr(f, k, val)
            else:
                f.params[k] = val
        if kind != "fail_start" and f.step is None and f.t is None:
            when = "step=N" if kind in ("nan", "slow") else "step=N or t=SECONDS"
            raise ValueError(f"chaos fault {item!r}: say when, with {when} ({takes(kind)})")
        if kind == "disk_full":
            _check_disk_full(f, item)
        if kind in ("node_kill", "link_cut"):
            _check_node_fault(f, item)
        if kind in ("kill", "stop", "nan", "slow") and f.rank is None:
            f.rank = 0
        if f.rank is not None and world is not None and not 0 <= f.rank < world:
            raise ValueError(f"chaos fault {item!r}: rank={f.rank}, but the job has {world} "
                             f"rank(s): 0..{world - 1}")  # fmt: skip
        for k, v in [("t", f.t), ("rank", f.rank), *f.params.items()]:
            if v is None:
                continue
            if k in POSITIVE and v <= 0:
                raise ValueError(f"chaos fault {item!r}: {k} must be > 0 ({takes(kind)})")
            if v < 0:
                raise ValueError(f"chaos fault {item!r}: {k} must be >= 0 ({takes(kind)})")
        if f.params.get("counted", 0) not in (0, 1):
            raise ValueError(f"chaos fault {item!r}: counted is 0 or 1 ({takes(kind)})")
        node, most = f.params.get("node"), nodes if nodes is not None else world
        if node is not None and most is not None and node >= most:
            has = f"{nodes} node(s): 0..{nodes - 1}" if nodes is not None else (
                f"at most {world} node(s), as it has {world} rank(s)")  # fmt: skip
            raise ValueError(f"chaos fault {item!r}: node={int(node)}, but the job has {has}")
        # The same fault twice is not two faults: both are due at the same poll (or the same
        # start) and strike together, once (a second SIGKILL of one pid; corrupt_ckpt twice
        # flips the same bytes back, leaving the checkpoint intact), yet the timeline and the
        # drill counted it as two injected faults, both "detected". nan is the exception: its
        # repeat fires on the loss guard's retry of that step (bad twice: the batch is skipped).
        if f.kind != "nan" and any(f.spec() == g.spec() for g in faults):
            raise ValueError(f"chaos fault {item!r} is given twice: the same fault at the same "
                             "time strikes once; give it once, or a later step= for a second "
                             "fault")  # fmt: skip
        faults.append(f)
    return faults


def _number(item: str, kv: str, v: str, kind: str) -> float:
    try:
        val = float(v)
    except ValueError:
        raise ValueError(f"chaos fault {item!r}: {kv!r} must be key=number "
                         f"({takes(kind)})") from None  # fmt: skip
    if val != val or val in (float("inf"), float("-inf")):
        raise ValueError(f"chaos fault {item!r}: {kv!r} must be a finite number ({takes(kind)})")
    return val


def beyond_the_job(faults: list[Fault], steps: int) -> list[str]:
    """One line for each fault whose step the job (train.steps) never reaches: it would
    never fire, and a drill would pass without it."""
    return [f"chaos fault {f.spec()!r} never fires: step {f.step + 1} is beyond train.steps="
            f"{steps}; give a step of 1..{steps}" for f in faults
            if f.step is not None and f.step >= steps]  # fmt: skip


def _check_disk_full(f: Fault, item: str) -> None:
    """A typo in a fault that fills a disk must not pass silently."""
    takes = "disk_full takes for=SECONDS or steps=N, keep_mb=MIB, max_gb=GIB"
    unknown = [k for k in f.params if k not in DISK_FULL_PARAMS]
    if unknown or f.rank is not None:
        raise ValueError(f"chaos fault {item!r}: unknown parameter {(unknown or ['rank'])[0]!r} ({takes})")  # fmt: skip
    if "for" in f.params and "steps" in f.params:
        raise ValueError(f"chaos fault {item!r}: give for=SECONDS or steps=N, not both")
    for k in ("for", "steps", "max_gb"):
        if k in f.params and f.params[k] <= 0:
            raise ValueError(f"chaos fault {item!r}: {k} must be > 0 ({takes})")
    if f.params.get("keep_mb", 0) < 0:
        raise ValueError(f"chaos fault {item!r}: keep_mb must be >= 0 ({takes})")


def _check_node_fault(f: Fault, item: str) -> None:
    takes = "node=N" + (", for=SECONDS" if f.kind == "link_cut" else "")
    allowed = ("node", "for") if f.kind == "link_cut" else ("node",)
    unknown = [k for k in f.params if k not in allowed] + (["rank"] if f.rank is not None else [])
    if unknown:
        raise ValueError(f"chaos fault {item!r}: unknown parameter {unknown[0]!r} ({f.kind} takes {takes})")  # fmt: skip
    if f.params.get("node", 0) < 0 or f.params.get("for", 1) <= 0:
        raise ValueError(f"chaos fault {item!r}: node must be >= 0 and for > 0 ({takes})")
    if f.kind == "link_cut" and "node" not in f.params:
        raise ValueError(f"chaos fault {item!r}: say which node's link, with node=N (n0 is 0)")


class ChaosDriver:
    """Fires the outside faults of a schedule while the supervisor polls heartbeats."""

    def __init__(self, faults: list[Fault], run_dir: Path, job: str, snapshot_root: str,
                 timeline, job_pid: int | None = None, steps: int | None = None,
                 says: str = "wanka train:") -> None:  # fmt: skip
        """`steps`: the job's train.steps, when known: a fault beyond it is said (one line
        each), as it would never fire."""
        self.faults, self.run_dir, self.job = faults, Path(run_dir), job
        self.job_pid = job_pid or os.getpid()
        self.job_pids: list[int] = []  # several (a cluster baseline's torchruns): all get SIGTERM
        self.snapshot_root, self.timeline = snapshot_root, timeline
        self.fired: dict[int, float] = {}  # fault id -> injection time
        self.fired_rank: dict[int, float] = {}  # rank -> last injection time hitting it
        # node -> (time of its last node_kill / link_cut, until when what happens to it is the
        # fault's doing: what follows a power loss or a cut, not the node's own fault)
        self.node_faults: dict[str, tuple[float, float]] = {}
        self.sigterm_time: float | None = None
        # (when, node indices; None: every node) of the fail_start faults handed to the attempt
        # now running: its start-up failures are the drill's doing (fault_time)
        self.start_faults: tuple[float, set[int | None]] | None = None
        self.node_hit: dict[int, str] = {}  # node_kill id -> the node it struck
        self.t_start = time.time()
        self.marks = self.run_dir / "resilience" / "chaos"
        self.starts_left = {
            f.id: f.params.get("times", 1) for f in faults if f.kind == "fail_start"
        }
        self._collect_inside_marks()  # a resubmitted job must not replay faults that fired
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.ballasts: dict[int, Ballast] = {}  # fault id -> the file filling the disk now
        # On the cluster-in-a-box (set by the caller): .kill_node(name), .set_link(name, up).
        self.cluster = None
        self.attempt_nodes: set[str] | None = None  # the nodes training now (cluster jobs)
        self.cuts: dict[int, tuple[str, float, str, float]] = {}  # id -> node, until, spec, t0
        self._owner = os.getpid()  # forked ranks inherit atexit handlers: only we release
        self._atexit = False
        remove_ballast(self.ckpt_dir)  # left behind by a supervisor that was SIGKILLed
        for f in faults:  # refuse now, in one line, rather than at step N of a long job
            if f.kind == "disk_full":
                check_fill_allowed(self.ckpt_dir, fill_cap_bytes(f))
        for line in beyond_the_job(faults, steps) if steps is not None else ():
            print(f"{says} {line}", file=sys.stderr, flush=True)

    def worker_spec(self) -> str:
        """Inside faults not yet fired, for the ranks of the next attempt."""
        self._collect_inside_marks()
        todo, now = [], time.time()
        self.start_faults = None  # called once per attempt: the last one's are over
        for f in self.faults:
            if f.kind == "fail_start" and self.starts_left.get(f.id, 0) > 0:
                self.starts_left[f.id] -= 1
                self.fired[f.id] = now
                todo.append(f)
                if f.params.get("counted"):  # drills the eviction policy: a real node's
                    continue
                _, nodes = self.start_faults or (now, set())
                nodes.add(None if "node" not in f.params else int(f.params["node"]))
                self.start_faults = (now, nodes)
            elif f.kind in ("nan", "slow") and f.id not in self.fired:
                todo.append(f)
        return ";".join(f"{f.spec()},id={f.id}" for f in todo)

    def _collect_inside_marks(self) -> None:
        specs = {f.id: f.spec() for f in self.faults}
        for p in self.marks.glob("*.fired") if self.marks.is_dir() else ():
            fid = int(p.stem) if p.stem.isdigit() else None
            if fid in self.fired or fid not in specs:
                continue
            try:  # a mark left by another schedule (another fault at that place) is not ours;
                # an empty one is from before marks named their fault: taken as ours, as then
                if p.read_text().strip() in ("", specs[fid]):
                    self.fired[fid] = p.stat().st_mtime
            except OSError:
                continue

    def inside_ids(self) -> list[int]:
        """The faults that fire inside a rank and mark it (nan, slow)."""
        return [f.id for f in self.faults if f.kind in ("nan", "slow")]

    def note_fired(self, marks: dict[int, tuple[float, str]]) -> None:
        """Inside faults that fired, as the control store reports them (fault id -> when,
        node): recorded as if the rank had marked the run directory (a resubmitted job does
        not replay them; the drill reads when they fired)."""
        by_id = {f.id: f for f in self.faults}
        for fid, (t, _node) in marks.items():
            if fid in self.fired:
                continue
            self.fired[fid] = t
            if fid in by_id:
                mark_fired(self.marks, by_id[fid], t)

    def injected_inside(self, kind: str, rank: int) -> bool:
        """A fault of `kind` fired inside rank `rank` (its mark file exists): e.g. a straggler
        the drill made, which says nothing about the node."""
        self._collect_inside_marks()
        return any(f.kind == kind and f.rank == rank and f.id in self.fired for f in self.faults)

    def fault_time(self, rank: int | None, node: str | None = None) -> float | None:
        """When the injected fault whose consequence this is happened: the last one that hit the
        rank, else one that hit its node within NODE_FAULT_AFTER_S (or a link cut still in
        place, which can make any node look lost); None: a fault not injected by us."""
        if rank is not None and rank in self.fired_rank:
            return self.fired_rank[rank]
        now = time.time()
        if node in self.node_faults and now <= self.node_faults[node][1]:
            return self.node_faults[node][0]
        if self.cuts:  # a cut link (of n0 above all, the store's) makes any node look lost
            return min(t0 for _, _, _, t0 in self.cuts.values())
        if self.start_faults is not None:  # ranks made to fail at start-up: the whole node's,
            t, nodes = self.start_faults  # or a node the name does not number (one host)
            index = _node_index(node) if node is not None else None
            if None in nodes or index is None or index in nodes:
                return t
        return None

    def poll(self, beats: dict[int, Beat], now: float, attempt: int,
             node_of: Callable[[int], str | None] | None = None) -> None:  # fmt: skip
        """Fire what is due. `node_of(rank)` names a rank's node (by default its heartbeat's
        .node file, which store mode keeps node-private: it passes the agents' reports)."""
        if node_of is None:
            from wanka.resilience.heartbeat import node_of as from_file

            hb = self.run_dir / "resilience" / "hb"
            node_of = functools.partial(from_file, hb)
        self._node_of = node_of
        self._release_due(beats, now)
        if not beats:
            return
        step = max(b.step for b in beats.values())
        # A rank at `step` still in "sync" has not passed that step's stop agreement yet: a
        # preemption notice sent now would stop the job before the step, not during it.
        running = any(b.step == step and b.phase != "sync" for b in beats.values())
        for f in self.faults:
            if f.kind not in OUTSIDE or f.id in self.fired:
                continue
            if f.step is None:
                reached = False
            elif f.kind == "sigterm":
                reached = step > f.step or (step == f.step and running)
            else:
                reached = step >= f.step
            due = reached or (f.t is not None and now - self.t_start >= f.t)
            if due and self._fire(f, beats):
                self.fired[f.id] = now
                mark_fired(self.marks, f)
                # Where it struck: a drill checks that the fault is named with this node.
                node = self._target_node(f)
                where = {"node": node} if node else {}
                if node and f.kind in ("node_kill", "link_cut") and self.attempt_nodes:
                    where["training"] = node in self.attempt_nodes  # else a hot spare
                self.timeline.event("chaos", now, now, fault=f.spec(), attempt_no=attempt,
                                    **where)  # fmt: skip

    def _target_node(self, f: Fault) -> str | None:
        if f.kind in ("kill", "stop"):
            return self._node_of(f.rank)
        if f.kind == "node_kill":
            return self.node_hit.get(f.id)
        if f.kind == "link_cut":
            return f"n{f.params['node']}" if "node" in f.params else self._node_of(0)
        return None

    def _fire(self, f: Fault, beats: dict[int, Beat]) -> bool:
        if f.kind in ("kill", "stop"):
            b = beats.get(f.rank)
            if b is None:
                return False
            try:
                os.kill(b.pid, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:
                # The rank is gone already (it died on its own and was reaped). Raised, this
                # aborted the supervisor's whole poll, before its dead/hang check, on every
                # poll until the attempt ended: the death was never named. Not fired: it
                # strikes the next attempt's rank when that reaches the step.
                return False
            self.fired_rank[f.rank] = time.time()
        elif f.kind == "node_kill":
            from wanka.resilience.snapshot import drop_node

            try:
                node = self._node_named(f, beats)
            except ValueError as e:  # the job has no such node: never retried
                self.fired[f.id] = time.time()
                print(f"wanka train: chaos {f.spec()} not injected: {e}", file=sys.stderr,
                      flush=True)  # fmt: skip
                return False
            if node is None:
                return False  # a rank has not said where it runs yet: try at the next poll
            self.node_hit[f.id] = node
            now = time.time()
            if self.cluster is not None:  # every process of the node first, as a power loss:
                try:  # its launcher must not see its ranks die and exit on its own
                    self.cluster.kill_node(node)
                except (ValueError, OSError) as e:  # e.g. no such node: never retried
                    self.fired[f.id] = now
                    print(f"wanka train: chaos {f.spec()} not injected: {e}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    return False
            for b in beats.values():
                if self._node_of(b.rank) != node:  # a rank of unknown node is not killed
                    continue
                try:
                    os.kill(b.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.fired_rank[b.rank] = now
            drop_node(Path(self.snapshot_root), self.job, node)
            self.node_faults[node] = (now, now + NODE_FAULT_AFTER_S)
        elif f.kind == "link_cut":
            return self._cut(f, beats)
        elif f.kind == "sigterm":
            self.sigterm_time = time.time()
            for pid in self.job_pids or [self.job_pid]:  # every node's launcher, on a cluster
                os.kill(pid, signal.SIGTERM)  # the job gets the notice; it reaches the ranks
        elif f.kind == "disk_full":
            return self._fill(f, beats)
        else:
            return damage_latest_checkpoint(self.run_dir / "checkpoints", f.kind)
        return True

    def _node_named(self, f: Fault, beats: dict[int, Beat]) -> str | None:
        """The node a node fault strikes: node=N is nN on the cluster-in-a-box; on other hosts,
        torch elastic's node rank N, whose ranks follow those of nodes 0..N-1 (so a job on one
        host is node 0); without node=, rank 0's. None: not known yet; ValueError: no such
        node in the job."""
        if "node" not in f.params:
            return self._node_of(0)
        index = int(f.params["node"])
        if self.cluster is not None:
            return f"n{index}"
        names = [self._node_of(r) for r in sorted(beats)]
        if any(_node_index(n) is not None for n in names if n is not None):
            return f"n{index}"  # cluster-in-a-box nodes (store mode): a rank of unknown node waits
        if None in names:
            return None
        hosts = list(dict.fromkeys(names))  # in rank order: node rank 0 first
        if index >= len(hosts):
            raise ValueError(f"the job has {len(hosts)} node(s): node=0..{len(hosts) - 1}")
        return hosts[index]

    # -- link_cut ------------------------------------------------------------------------------
    def _cut(self, f: Fault, beats: dict[int, Beat]) -> bool:
        node = f"n{f.params['node']}"
        if self.cluster is None:
            self.fired[f.id] = time.time()  # never retried
            print(f"wanka train: chaos {f.spec()} not injected: link faults need a --cluster "
                  "job on the cluster-in-a-box", file=sys.stderr, flush=True)  # fmt: skip
            return False
        try:
            self.cluster.set_link(node, False)
        except ValueError as e:
            self.fired[f.id] = time.time()
            print(f"wanka train: chaos {f.spec()} not injected: {e}", file=sys.stderr, flush=True)
            return False
        now = time.time()
        self.cuts[f.id] = (node, now + f.params.get("for", LINK_CUT_FOR_S), f.spec(), now)
        self.node_faults[node] = (now, float("inf"))  # until restored (_restore_links)
        for b in beats.values():  # what the cut makes of them is injected, not the node's fault
            if self._node_of(b.rank) == node:
                self.fired_rank[b.rank] = now
        if not self._atexit:
            atexit.register(self.close)
            self._atexit = True
        return True

    def _restore_links(self, now: float, all_: bool = False) -> None:
        for fid, (node, until, spec, t0) in list(self.cuts.items()):
            if all_ or now >= until:
                del self.cuts[fid]
                try:
                    self.cluster.set_link(node, True)
                except ValueError as e:  # the node was removed meanwhile: nothing to restore
                    print(f"wanka train: chaos: link of {node} not restored: {e}", file=sys.stderr)
                self.timeline.event("chaos", t0, time.time(), fault=spec, released=True, node=node)
                self.node_faults[node] = (t0, time.time() + NODE_FAULT_AFTER_S)

    def restore_due(self) -> None:
        """Restore the links whose cut is over (also between attempts, when nobody polls)."""
        self._restore_links(time.time())

    # -- disk_full -----------------------------------------------------------------------------
    def _fill(self, f: Fault, beats: dict[int, Beat]) -> bool:
        try:
            path = fill_disk(self.ckpt_dir, int(f.params.get("keep_mb", 0) * MIB),
                             fill_cap_bytes(f), name=f"{BALLAST}-{f.id}")  # fmt: skip
        except (ValueError, OSError) as e:  # refused (safety cap) or failed: never retried
            self.fired[f.id] = time.time()
            print(f"wanka train: chaos {f.spec()} not injected: {e}", file=sys.stderr, flush=True)
            return False
        now = time.time()
        base = f.step if f.step is not None else max(b.step for b in beats.values())
        self.ballasts[f.id] = Ballast(
            path,
            f.spec(),
            now,
            until_t=None if "steps" in f.params else now + f.params.get("for", DISK_FULL_FOR_S),
            until_step=base + int(f.params["steps"]) if "steps" in f.params else None,
        )
        if not self._atexit:  # whatever ends the supervisor, the disk is not left full
            atexit.register(self.close)
            self._atexit = True
        free = shutil.disk_usage(self.ckpt_dir).free / MIB
        print(f"wanka train: chaos {f.spec()}: filled the filesystem of {self.ckpt_dir} "
              f"({free:.1f} MiB left free)", file=sys.stderr, flush=True)  # fmt: skip
        return True

    def _release_due(self, beats: dict[int, Beat], now: float) -> None:
        self._restore_links(now)
        step = max((b.step for b in beats.values()), default=None)
        for fid, b in list(self.ballasts.items()):
            if (b.until_t is not None and now >= b.until_t) or (
                b.until_step is not None and step is not None and step >= b.until_step
            ):
                self._release(fid)

    def _release(self, fid: int) -> None:
        ballast = self.ballasts.pop(fid, None)
        if ballast is not None:
            ballast.path.unlink(missing_ok=True)
            # The fill's whole window: `wanka report` marks the failed saves inside it injected.
            self.timeline.event("chaos", ballast.t_fill, time.time(), fault=ballast.spec,
                                released=True)  # fmt: skip
            print(f"wanka train: chaos: {ballast.path} removed, the disk has room again",
                  file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        """Remove every ballast still in place (the job ended before its time was up)."""
        if os.getpid() != self._owner:
            return
        self._restore_links(time.time(), all_=True)
        for fid in list(self.ballasts):
            self._release(fid)


@dataclass
class Ballast:
    path: Path
    spec: str  # the fault, as written in the schedule
    t_fill: float  # when the disk was filled
    until_t: float | None  # released at this time (for=SECONDS) ...
    until_step: int | None  # ... or once the job reaches this step (steps=N)


def fill_cap_bytes(f: Fault | None = None) -> int:
    """The largest filesystem disk_full may fill: the fault's max_gb, else the environment's
    WANKA_CHAOS_FILL_MAX_GB, else 4 GiB."""
    if f is not None and "max_gb" in f.params:
        return int(f.params["max_gb"] * GIB)
    env = os.environ.get(FILL_CAP_ENV, "")
    try:
        gb = float(env) if env else FILL_CAP_GB
    except ValueError:
        raise ValueError(f"{FILL_CAP_ENV}={env!r} must be a number of GiB") from None
    return int(gb * GIB)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_fill_allowed(path: Path, cap_bytes: int) -> None:
    """Refuse (ValueError, one line) to fill a filesystem larger than the cap: a shared disk
    filled to the brim breaks every other process on it."""
    total = shutil.disk_usage(_existing(path)).total
    if total > cap_bytes:
        raise ValueError(f"disk_full would fill the {total / GIB:.1f} GiB filesystem holding {path}, "
                         f"over the {cap_bytes / GIB:g} GiB safety cap: put the checkpoints on a small "
                         "filesystem of their own (mount -t tmpfs -o size=128m tmpfs DIR, or wanka "
                         f"chaos drill --ckpt-fs-mb 128) or raise the cap ({FILL_CAP_ENV}=GIB or "
                         "max_gb=GIB in the fault)")  # fmt: skip


def free_bytes(path: Path) -> int:
    """Room left for this process: root may also use the blocks reserved for root."""
    st = os.statvfs(_existing(path))
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def fill_disk(root: Path, keep_bytes: int, cap_bytes: int, name: str = BALLAST) -> Path:
    """Fill the filesystem holding `root` with the ballast file root/name, leaving about
    keep_bytes free; returns its path. Refuses filesystems over cap_bytes."""
    root.mkdir(parents=True, exist_ok=True)
    check_fill_allowed(root, cap_bytes)
    path = root / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = free_bytes(root) - keep_bytes
        if size > 0:
            _allocate(fd, size, keep_bytes)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def _allocate(fd: int, size: int, keep_bytes: int) -> None:
    """Real blocks, not a sparse file. fallocate takes milliseconds; where the exact size does
    not fit (the file's own metadata needs blocks too) or fallocate is not supported, allocate
    a little less and write zeros to the brim (the supervisor's monitor waits meanwhile)."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError:
        pass
    if size > 16 * MIB:
        try:
            os.posix_fallocate(fd, 0, size - 16 * MIB)
        except OSError:
            pass
    end = os.lseek(fd, 0, os.SEEK_END)
    for chunk in (bytes(MIB), bytes(4096), bytes(512)):  # down to the last block
        try:
            while True:
                end += os.write(fd, chunk)
        except OSError:
            pass
    if keep_bytes:
        os.ftruncate(fd, max(end - keep_bytes, 0))


def remove_ballast(root: Path) -> list[Path]:
    """Delete every ballast file in root (returns what it removed)."""
    gone = sorted(root.glob(BALLAST + "*")) if root.is_dir() else []
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


@contextmanager
def small_filesystem(path: Path, size_mb: int) -> Iterator[Path]:
    """Mount a size_mb MiB tmpfs at `path` (an empty or new directory) for the block, so a
    disk_full drill fills it and nothing else; unmounted afterwards, whatever happens (its
    files go with it). Needs root on Linux; ValueError in one line when it cannot."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise ValueError(f"{path} is not empty: a filesystem mounted there would hide its files "
                         "(use a new run directory)")  # fmt: skip
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb)}m", "tmpfs", str(path)],
                       capture_output=True, text=True, check=False)  # fmt: skip
    if r.returncode:
        why = (r.stderr.strip() or f"exit {r.returncode}").splitlines()[-1]
        raise ValueError(f"cannot mount a {size_mb} MiB tmpfs at {path} ({why}): run as root on "
                         "Linux, or put the checkpoints on a small filesystem yourself")  # fmt: skip
    try:
        yield path
    finally:
        _unmount(path)


def _unmount(path: Path) -> None:
    for _ in range(20):  # a process that just exited may still hold a file open for a moment
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.25)
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)  # detach


def tmpfs_unavailable() -> str | None:
    """Why a tmpfs cannot be mounted here (None when it can): the tests skip with this."""
    if sys.platform != "linux":
        return "mounting a tmpfs needs Linux"
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    with tempfile.TemporaryDirectory() as d:
        try:
            with small_filesystem(Path(d), 1):
                return None
        except ValueError as e:
            return str(e)


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
        mark_fired(self.marks, f)

    def at_start(self) -> None:
        # n1 is node 1 on the cluster-in-a-box; elsewhere torch elastic's node rank (GROUP_RANK)
        # numbers the hosts, and a job on one host is node 0.
        name = os.environ.get("WANKA_NODE", "")
        node = _node_index(name)
        if node is None:
            group = os.environ.get("GROUP_RANK", "0")
            node = int(group) if group.isdigit() else 0
        if any(f.kind == "fail_start" and f.params.get("node") in (None, node)
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


def mark_fired(marks: Path, f: Fault, t: float | None = None) -> None:
    """Mark that fault f fired (a resubmitted job does not replay it): MARKS/<id>.fired, named
    by its place in the schedule (drill.py and the node agents read that), holding its spec, so
    that a mark a run directory kept from another schedule suppresses no other fault."""
    marks.mkdir(parents=True, exist_ok=True)
    path = marks / f"{f.id}.fired"
    tmp = marks / f".{f.id}.fired.tmp"  # whole or absent: a reader never sees it empty
    tmp.write_text(f.spec() + "\n")
    if t is not None:
        os.utime(tmp, (t, t))
    os.replace(tmp, path)


def _node_index(name: str) -> int | None:
    """Cluster-in-a-box nodes are named n0, n1, ...; `node=1` in a schedule means n1."""
    return int(name[1:]) if name[:1] == "n" and name[1:].isdigit() else None
