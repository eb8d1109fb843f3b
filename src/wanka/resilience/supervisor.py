"""The supervisor: `wanka train` runs the ranks under it and brings the job back after faults.

Per attempt it builds torchrun's own launch config (same flags, same rendezvous) and runs
torch.distributed.elastic's agent in this process, with two changes: workers are *forked* from
this process, which has already imported torch and wanka (a restart costs a fork, not an
interpreter start and a 3 s import), and the agent never restarts by itself (max_restarts=0):
this loop decides, because it knows more than "a worker exited":

* a monitor thread reads every rank's heartbeat (resilience/heartbeat.py), learns phase
  time-outs, notices dead and hung ranks within a poll, dumps stacks, kills the attempt;
* each exit is classified (success, user error, preempted, crash, hang, start-up failure),
  written to the fault ledger and the run's timeline, and retried with back-off within a
  budget, resuming from the newest in-memory snapshot or the newest valid DCP checkpoint;
* attempts that make no progress end the job with a message instead of looping forever.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from wanka.config import JobConfig
from wanka.resilience import rank_logs
from wanka.resilience.chaos import ChaosDriver, Fault
from wanka.resilience.goodput import TimelineWriter
from wanka.resilience.heartbeat import exit_code, exit_message, node_of, phase_words, read_all
from wanka.resilience.ledger import EvictionPolicy, FaultLedger
from wanka.resilience.monitor import (
    UNSTICK_AFTER_S,
    HangMonitor,
    StopRequested,
    Timeouts,
    dump_stacks,
    process_state,
    stragglers,
    user_code_fault,
)

# The phases of a training step (heartbeat.py's, less start-up, saves to disk and the end).
TRAIN_PHASES = ("data", "sync", "forward", "backward", "optimizer", "snapshot")

log = logging.getLogger("wanka.supervisor")
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a last-gasp checkpoint; relaunch
STRAGGLER_STEPS = 3  # slow in this many steps = a straggler


@dataclass
class Outcome:
    cause: str  # success, user_error, preempted, process_crash, hang, startup_failure
    rank: int | None = None
    detail: str = ""
    t_fault: float | None = None  # when it happened, when known (injection, last progress)
    t_detect: float | None = None
    max_step: int = -1  # highest step any rank started in this attempt
    codes: list[int] = field(default_factory=list)
    node: str | None = None  # where it happened, when known
    confirmed: bool = False  # preempted: every rank wrote its part of the last-gasp checkpoint
    exits: dict[int, int] = field(default_factory=dict)  # global rank -> exit code (the agent's)
    error: str | None = None  # the failed rank's last exception line, from its log
    said: str | None = None  # user_error: what the rank said (one line), printed by run()
    launcher_killed: tuple[str, int] | None = None  # (node, code): its launcher died of a signal
    limit_s: float | None = None  # the learned hang limit the fault was detected within
    launch_failed: bool = False  # the launcher's own error (a rendezvous that never formed)
    never_met: bool = False  # ... before any rank of this host started


def _blame(out: Outcome, hb_dir: Path, attempt: int) -> None:
    """The agent saw a rank die before the monitor did: name the rank that died first (the
    agent ends its peers with SIGTERM, -15) and where it was, from its heartbeat."""
    culprits = sorted(r for r, c in out.exits.items() if c not in (*STOPPED, 0))
    if not culprits:
        return
    out.rank = culprits[0]
    beat = read_all(hb_dir).get(out.rank)
    if beat is not None and beat.attempt == attempt:
        out.detail = f"rank {out.rank} died in {beat.phase} of step {beat.step + 1}"
    else:
        out.detail = f"rank {out.rank} died (exit code {out.exits[out.rank]})"


# How a process that was ended with SIGTERM (a peer failed, or a stop) exits: torchrun reports
# its ranks as -15, a node agent (control/agent.py) exits 128 + 15 like a shell.
STOPPED = (-signal.SIGTERM, 128 + signal.SIGTERM)


def cause_of_codes(codes: list[int], max_step: int) -> str:
    """The cause an attempt's non-zero exit codes (per node, or per rank) name on their own."""
    if not codes:
        return "success"
    if EXIT_PREEMPTED in codes:
        return "preempted"
    if EXIT_USER_ERROR in codes and all(c in (EXIT_USER_ERROR, 1, *STOPPED) for c in codes):
        return "user_error"  # the others were ended because of it
    return "startup_failure" if max_step < 0 else "process_crash"


def resilience_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "resilience"


def job_id(run_dir: Path) -> str:
    """Stable for one run directory, new if it is deleted or copied: keys the shared-memory
    snapshots. A copy (`cp -a run run2`) carries the job_id file along; the folder's inode,
    recorded beside it, tells the copy from the original (a `mv` keeps the inode, and so the
    snapshots; nodes that share the run directory over NFS see the same inode)."""
    from wanka.resilience.snapshot import atomic_write  # (readers on other hosts: all or none)

    path = resilience_dir(run_dir) / "job_id"
    path.parent.mkdir(parents=True, exist_ok=True)
    where = path.with_name("job_id.inode")
    inode = str(Path(run_dir).stat().st_ino)
    try:
        recorded = where.read_text().strip()
    except OSError:
        recorded = ""
    # Unknown (recorded before inodes were, or being written by another host): the original.
    copied = recorded.isdigit() and recorded != inode
    if not path.is_file() or copied:
        atomic_write(path, f"{Path(run_dir).resolve().name}-{uuid.uuid4().hex[:8]}".encode())
    if copied or not recorded.isdigit():
        atomic_write(where, (inode + "\n").encode())
    return path.read_text().strip()


def _worker_entry(argv: list[str], env: dict[str, str]) -> None:
    """Runs in each forked rank: the same `wanka train` as under plain torchrun."""
    os.environ.update(env)
    os.environ["WANKA_RANK_START_TIME"] = repr(time.time())  # start-up parts (trainer.py)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)  # the agent's handlers came along with the fork
    import torch

    # The thread pool size was fixed when the parent imported torch: apply OMP_NUM_THREADS as
    # torchrun's own ranks would (else each forked rank runs as many threads as cores).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    from wanka.cli import main

    rc = main(argv)
    sys.stdout.flush()
    if rc:
        sys.exit(rc)
    # Done. A SIGTERM (the agent's death signal on a stop request) that came after the last
    # step boundary was only noted: no stop agreement follows. The rank then waited in torch's
    # worker wrapper for the agent to read its result, which a shutting-down agent never does:
    # it waited 30 s twice for the rank to end, then SIGKILLed it (a stop request in the job's
    # last seconds cost 60 s). From here a SIGTERM ends the rank, and one already noted does.
    from wanka.resilience import worker

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.SIGTERM in worker.STOP_SIGNALS:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)


def _finished(run_dir: Path, summary_before: tuple | None, steps: int) -> bool:
    """Whether rank 0 wrote the job's summary of all `steps` since the supervisor started
    (summary_before: the file's identity then): the job has ended, whatever stopped it after."""
    path = run_dir / "summary.json"
    if _file_id(path) in (None, summary_before):
        return False
    try:
        return json.loads(path.read_text())["steps"] == steps
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _file_id(path: Path) -> tuple | None:
    """What tells a rewritten file from the one that was there (no clock comparison: the run
    directory may be on a file server with a clock of its own)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class Supervisor:
    def __init__(self, cfg: JobConfig, worker_argv: list[str], nproc: int,
                 rdzv: dict | None = None, chaos: list[Fault] | None = None,
                 node: str | None = None, cluster_state: str | None = None) -> None:  # fmt: skip
        self.cfg, self.worker_argv, self.nproc = cfg, worker_argv, nproc
        # Lines are prefixed with the command the user ran (wanka train / distill / rl / sft).
        self.says = f"wanka {worker_argv[0] if worker_argv else 'train'}:"
        self.rdzv = dict(rdzv or {})
        self.rc = cfg.resilience
        self.run_dir = Path(cfg.run.dir)
        self.dir = resilience_dir(self.run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.job = job_id(self.run_dir)
        if self.rc.snapshot_every > 0:  # whose snapshots these are: `wanka clean`, the sweep
            from wanka.train.run_lock import write_owner

            try:
                write_owner(self.rc.snapshot_dir, self.job, self.run_dir)
            except OSError:
                pass  # no snapshot dir: the ranks' snapshot store says why
        self.node = node or os.environ.get("WANKA_NODE") or socket.gethostname()
        self.timeline = TimelineWriter(self.dir / "timeline.jsonl", attempt=0)
        self.ledger = FaultLedger(self.rc.ledger)
        self.policy = EvictionPolicy(self.rc.evict_after, self.rc.evict_window_s,
                                     self.rc.evict_same_cause)  # fmt: skip
        self.timeouts = Timeouts(self.dir / "timeouts.json", self.rc.hang_factor,
                                 self.rc.hang_floor_s, self.rc.hang_initial_s)  # fmt: skip
        self.chaos = ChaosDriver(chaos or [], self.run_dir, self.job, self.rc.snapshot_dir,
                                 self.timeline, steps=cfg.train.steps, says=self.says)  # fmt: skip
        self.outcomes: list[Outcome] = []
        self.attempt = 0
        self.cluster = None
        if cluster_state is not None:
            from wanka.cluster.state import require

            self.cluster = require(cluster_state or None)
            from wanka.cluster.nodes import NodeActions, sweep_node_snapshots

            for line in sweep_node_snapshots(self.cluster, self.rc.snapshot_dir,
                                             self.rc.snapshot_max_age_h, self.job):  # fmt: skip
                print(f"{self.says} {line}", file=sys.stderr, flush=True)

            self.chaos.cluster = NodeActions(cluster_state or None)
            # Nodes the job trains on; the other healthy ones stand by as hot spares.
            healthy = len(self.active_nodes())
            self.width = healthy - self.rc.spare_nodes
            if self.width < 1:
                evicted = len(self.cluster.nodes) - healthy
                raise ValueError(f"resilience.spare_nodes={self.rc.spare_nodes} leaves no node to "
                                 f"train on: the cluster has {healthy} healthy node(s)"
                                 + (f" ({evicted} evicted, see `wanka nodes`)" if evicted else "")
                                 + "; set it below that")  # fmt: skip
            if any(f.kind == "link_cut" for f in self.chaos.faults):
                for n in self.cluster.nodes:  # a drill killed during a cut left a link down
                    try:
                        self.chaos.cluster.set_link(n.name, True)
                    except ValueError:
                        pass  # no link to restore (node removed): its start says so
        self.nnodes = int(str(self.rdzv.get("nnodes") or 1).split(":")[-1])  # torchrun's max
        # resilience.control = "store": resilience/store_attempt.py on the cluster-in-a-box,
        # resilience/host_control.py for one supervisor per host (Slurm, Kubernetes).
        self.control = None
        self.follows = False  # a host that carries out another host's decisions
        if self.rc.control == "store" and self.cluster is not None:
            from wanka.resilience.store_attempt import StoreControl

            self.control = StoreControl(self)
        elif self.rc.control == "store" and self.nnodes > 1:
            from wanka.resilience.host_control import HostControl

            self.control = HostControl(self)
            self.follows = not self.control.coordinating
        elif self.rc.control == "store":
            log.warning("resilience.control = store applies to jobs of several nodes: "
                        "watching files")  # fmt: skip
        self._preempt = threading.Event()
        self._unstick = threading.Event()  # the watch stopped a stuck launcher (not a preemption)
        self._in_agent = False  # torch's elastic agent runs in this process (its rendezvous...)
        self.stop_requested = self._preempt  # what the host control's waits look at
        self._warned: set[str] = set()
        self._warm = None  # the next cluster attempt's launchers (resilience/cluster_attempt.py)
        self.nodes: list = []  # the cluster nodes of the current attempt, in node-rank order
        # The loss curve of a train job is drawn here once the ranks are gone, not by rank 0
        # while every other rank waits at the job's last barrier holding its node. Under Slurm
        # each node runs its own supervisor: there rank 0 still draws it (one writer).
        self.draws_loss_curve = worker_argv[:1] == ["train"] and (
            self.cluster is not None or self.nnodes == 1
        )

    # -- one attempt -------------------------------------------------------------------------
    def _launch_config(self, attempt: int = 1):
        from torch.distributed.run import config_from_args, parse_args

        from wanka.distributed.launch import quiet_launcher_logs, torchrun_args

        quiet_launcher_logs()  # config_from_args prints torchrun's OMP_NUM_THREADS banner
        rdzv = self.control.rdzv(attempt) if self._hosts() else self.rdzv
        config, _, _ = config_from_args(parse_args(torchrun_args(self.nproc, rdzv, ["x"])))
        # Fork is the point (no interpreter start, no re-import) but CUDA/NPU state does not
        # survive a fork: accelerator jobs spawn.
        from wanka.device import resolve_device_type

        cpu = resolve_device_type(self.cfg.run.device) == "cpu"
        config.start_method = "fork" if cpu else "spawn"
        config.max_restarts = 0  # restarts are decided here
        config.monitor_interval = 0.05
        config.signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
        config.shutdown_timeout = 60  # room for the last-gasp checkpoint
        return config

    def _attempt(self, attempt: int) -> Outcome:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import elastic_launch

        from wanka.distributed.launch import quiet_launcher_logs

        quiet_launcher_logs()  # we report faults in one line

        # Across hosts with the control store, each host's own folder (its agent publishes it).
        hb_dir = self.control.hb_dir(attempt) if self._hosts() else self.dir / "hb"
        # Under Slurm every node runs a supervisor on the shared run directory: they race here.
        for old in hb_dir.glob("rank*.*") if hb_dir.is_dir() else ():
            old.unlink(missing_ok=True)
        env = {"WANKA_SUPERVISED": "1", "WANKA_ATTEMPT": str(attempt), "WANKA_JOB_ID": self.job,
               "WANKA_HB_DIR": str(hb_dir), "WANKA_NODE": self.node,
               "WANKA_LAUNCH_TIME": repr(time.time()), "WANKA_MTBF_S": repr(self._mtbf()),
               "WANKA_CHAOS": self.chaos.worker_spec(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # fmt: skip
        if self._hosts():  # a drill's inside faults mark the host's own folder, not the run dir
            env["WANKA_CHAOS_MARKS"] = str(hb_dir / "chaos")
        if self.draws_loss_curve:
            from wanka.report import LOSS_CURVE_LATER

            env[LOSS_CURVE_LATER] = "1"
        out = Outcome("success")
        self._unstick.clear()
        self.chaos.restore_due()  # a cut that ended between attempts, before the first poll
        self._log_marks = rank_logs.offsets(self.run_dir)  # what this attempt's ranks log follows
        stop = threading.Event()
        if self.cluster is not None:
            prev, self.nodes = self.nodes, self.attempt_nodes()
            self.chaos.attempt_nodes = {n.name for n in self.nodes}  # a node fault's target
            if prev and (moved := [n.name for n in self.nodes if n not in prev]):
                print(f"{self.says} hot spare {', '.join(moved)} takes the place of "
                      f"{', '.join(n.name for n in prev if n not in self.nodes)}",
                      file=sys.stderr, flush=True)  # fmt: skip
        if self.control is not None:
            self.control.begin(attempt, self.nodes, self.spare_nodes() if self.cluster else [])
            if self._hosts() and self.control.orphaned:  # the store did not answer: no attempt
                node = self.node if not self.follows else self.control.host
                out.cause, out.node, out.t_detect = "node_lost", node, time.time()
                out.detail = (
                    f"the control store at {self.control.host}:{self.control.port} did not answer"
                )
                return out
        watch = self.control.watch if self.control is not None else self._watch
        watcher = threading.Thread(target=watch, args=(hb_dir, attempt, out, stop),
                                   name="wanka-monitor", daemon=True)  # fmt: skip
        watcher.start()
        import torch.distributed as dist
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.rendezvous.api import RendezvousError

        launch_error: Exception | None = None

        try:
            try:
                if self.cluster is not None:
                    self._cluster_attempt(attempt, env, out, stop)
                else:
                    self._in_agent = True
                    try:
                        elastic_launch(self._launch_config(attempt), _worker_entry)(
                            self.worker_argv, env
                        )
                    finally:
                        self._in_agent = False
            except ChildFailedError as e:
                out.codes = [f.exitcode for f in e.failures.values()]
                out.exits = {int(r): f.exitcode for r, f in e.failures.items()}
            except SignalException as e:
                if not self._ours(e.sigval):
                    out.cause, out.detail = "preempted", f"signal {e.sigval}"
                    self._preempt.set()
            except (RendezvousError, dist.DistError) as e:  # a peer host missing, late or gone
                launch_error = e
            finally:
                # First: the agent left its own handlers behind, and a late SIGTERM of the
                # watch's own (see _watch) must land on ours, which know it.
                self._catch_stop_requests()
                stop.set()
                watcher.join()
        except SignalException as e:  # delivered between the agent's return and the swap:
            if not self._ours(e.sigval):  # ours, or a second stop request (Ctrl-C twice)
                self._preempt.set()
                if out.cause not in ("preempted", "success"):  # a finished job stays finished
                    out.cause, out.detail = "preempted", f"signal {e.sigval}"
            self._catch_stop_requests()
            stop.set()
            watcher.join()
        if not self.follows:  # learned from every host's ranks by the coordinator only
            self.timeouts.save()
        if launch_error is not None and out.cause == "success":  # unless the watch named it
            out.cause = "startup_failure" if out.max_step < 0 else "process_crash"
            first = (str(launch_error).strip().splitlines() or [""])[0][:200]
            out.detail = f"{type(launch_error).__name__}: {first}"
            out.t_detect = out.t_detect or time.time()
            out.launch_failed = True  # no rank's exit code to go by (read as success before)
            # No rank of this host ever beat: its hosts never met (else a host that served the
            # store crashed during set-up, a fault to restart from)
            out.never_met = not any(hb_dir.glob("rank*"))
        if out.launcher_killed is not None:
            self._node_lost(out)
        if out.cause == "node_lost" and out.node and self._warm is not None:
            self._warm.discard(out.node)  # however it was named: its spare is not to be trusted
        # What the ranks said on exit. A stop request ends the job whether or not the ranks
        # managed their last-gasp checkpoint; `confirmed` says whether they did.
        marks = self.control.exit_marks() if self.control is not None else None
        if marks is not None:  # what the node agents published
            codes = {code for code, _ in marks.values()}
        else:
            codes = {exit_code(hb_dir, int(p.stem[4:])) for p in hb_dir.glob("rank*.exit")} - {None}
        if EXIT_PREEMPTED in codes or self._preempt.is_set():
            out.cause = "preempted"
        elif EXIT_USER_ERROR in codes and out.cause != "preempted":
            out.cause = "user_error"
        out.confirmed = EXIT_PREEMPTED in codes
        self._classify(out)
        if out.cause == "process_crash" and out.rank is None:
            _blame(out, hb_dir, attempt)
        if out.node is None and out.rank is not None:
            out.node = node_of(hb_dir, out.rank)
        if out.cause in ("process_crash", "startup_failure", "user_code") and out.rank is not None:
            out.error = rank_logs.last_exception(self.run_dir, out.rank, self._log_marks)
        if out.cause == "user_error" and marks is not None:
            out.said = next(filter(None, (marks[r][1] for r in sorted(marks))), out.said)
        elif out.cause == "user_error":  # rank 0's words first: every rank usually says the same
            ranks = sorted(int(p.stem[4:]) for p in hb_dir.glob("rank*.exit"))
            out.said = next(filter(None, (exit_message(hb_dir, r) for r in ranks)), None)
        if self._hosts():  # the other hosts' ranks stop too, whoever saw the fault first
            self.control.conclude(attempt, out)
        return out

    def _hosts(self) -> bool:
        """One supervisor per host, coordinated through the control store (host_control.py)."""
        return self.control is not None and self.cluster is None

    def _catch_stop_requests(self) -> None:
        """A stop request between attempts (or on the cluster, where no elastic agent runs in
        this process) must end the job, not be lost or raise: the local elastic agent installs
        its own handlers for the length of an attempt. It leaves them behind: a second Ctrl-C
        after the first would raise its SignalException wherever this process then is (the
        interpreter's exit: a bare traceback); so its SIGINT, SIGHUP and SIGQUIT handlers
        are replaced too (never Python's own KeyboardInterrupt before the first attempt)."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_stop_request)
        from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            if signal.getsignal(sig) is _terminate_process_handler:
                signal.signal(sig, self._on_stop_request)

    def _on_stop_request(self, signum: int, _frame) -> None:
        if self._in_agent:
            # The agent is still before its ranks (their start installs its own handlers):
            # waiting at a multi-node rendezvous, it would go on waiting for the other hosts
            # (up to the join time-out) with the request only noted. End it as its handler
            # would; _attempt tells a stop request from the watch's own SIGTERM.
            from torch.distributed.elastic.multiprocessing.api import SignalException

            self._in_agent = False
            raise SignalException(f"signal {signum} before the ranks started",
                                  sigval=signal.Signals(signum))  # fmt: skip
        if not self._ours(signum):
            self._preempt.set()

    def _ours(self, signum) -> bool:
        """Whether a SIGTERM is the one the watch sent to stop a stuck launcher (consumed)."""
        if signum == signal.SIGTERM and self._unstick.is_set():
            self._unstick.clear()
            return True
        return False

    def _fits(self, nodes: int) -> bool:
        from wanka.distributed.parallel_dims import ParallelDims, ParallelError

        try:
            ParallelDims.from_config(self.cfg.parallel, nodes * self.nproc)
        except ParallelError:
            return False
        return True

    def _mtbf(self) -> float:
        """Mean time between faults on this job's nodes over the last day, from the ledger."""
        day = time.time() - 86400
        nodes = [n.name for n in self.cluster.nodes] if self.cluster else [self.node]
        n = sum(len(self.ledger.faults(node, since=day)) for node in nodes)
        return 86400.0 / n if n else self.cfg.checkpoint.mtbf_s

    def active_nodes(self) -> list:
        evicted = self.ledger.evicted()
        return [n for n in self.cluster.nodes if n.name not in evicted]

    def attempt_nodes(self) -> list:
        """The next attempt's nodes: the last attempt's, with a hot spare in the place of a
        node that was named lost or hung, or evicted (resilience/cluster_attempt.py)."""
        from wanka.resilience.cluster_attempt import SUSPECT_CAUSES, choose_nodes

        last = self.outcomes[-1] if self.outcomes else None
        suspect = last.node if last is not None and last.cause in SUSPECT_CAUSES else None
        return choose_nodes(self.active_nodes(), [n.name for n in self.nodes], self.width,
                            suspect)  # fmt: skip

    def spare_nodes(self) -> list:
        """Active nodes the current attempt does not train on."""
        return [n for n in self.active_nodes() if n not in self.nodes]

    def _forks(self) -> bool:
        """Ranks fork from their (warm) launcher; CUDA/NPU state does not survive a fork."""
        from wanka.device import resolve_device_type

        return resolve_device_type(self.cfg.run.device) == "cpu"

    def _start_first_launchers(self) -> None:
        """A cluster job's first launchers start importing now, under the pre-flight and the
        control store's start, as later attempts' are started under the attempt before."""
        # Not under a full pre-flight: its timed burn-in and link checks would share the CPUs.
        if (
            self.cluster is None
            or not self._forks()
            or self.rc.preflight == "full"
            or not self.rc.warm_launchers
        ):
            return
        from wanka.resilience.cluster_attempt import WarmLaunchers

        self._warm = WarmLaunchers(self.run_dir / "logs", self.control)
        self._warm.prepare(1, self.attempt_nodes())

    def _cluster_attempt(
        self, attempt: int, env: dict, out: Outcome, stop: threading.Event
    ) -> None:
        from wanka.resilience.cluster_attempt import WarmLaunchers, run_attempt

        # WANKA_NODE is replaced by each node's own name (cluster/nodes.py node_env).

        if self._warm is None:
            self._warm = WarmLaunchers(self.run_dir / "logs", self.control)
        end = run_attempt(self.cluster, self.nodes, self.nproc, self.worker_argv, env,
                          attempt, stop, self._preempt, self.run_dir / "logs",
                          launcher=self.control, warm=self._warm,
                          start_method="fork" if self._forks() else "spawn",
                          started=lambda: out.max_step >= 0, spares=self.spare_nodes(),
                          prewarm=self.rc.warm_launchers)  # fmt: skip
        if any(end.codes):
            out.codes = [c for c in end.codes if c]
            out.node = out.node or end.failed
            if end.own_code is not None and end.own_code < 0:  # the node's launcher was killed
                out.launcher_killed = (end.failed, end.own_code)
                out.t_detect = out.t_detect or end.t_failed

    def _node_lost(self, out: Outcome) -> None:
        """A node's launcher (its agent in store mode, its torchrun otherwise) killed by a
        signal we did not send: the node went, and what its peers' ranks did after (crash on a
        reset connection, hang) follows from that, so it is named, not them."""
        node, code = out.launcher_killed
        if out.cause in ("user_error", "preempted") or out.cause.startswith("node"):
            return
        try:
            how = signal.Signals(-code).name
        except ValueError:
            how = f"signal {-code}"
        what = "agent" if self.control is not None else "node launcher"
        out.cause, out.rank, out.node = "node_lost", None, node
        out.detail = f"its {what} was killed ({how})"
        out.t_fault = self.chaos.fault_time(None, node) or out.t_fault
        out.t_detect = out.t_detect or time.time()

    def _classify(self, out: Outcome) -> None:
        if out.cause in ("hang", "preempted", "user_error", "user_code") or out.cause.startswith(
            "node"
        ):
            return
        if out.launch_failed and not out.codes:  # named from the launcher's error: no codes
            return  # (an empty list of them reads as success)
        if out.cause == "process_crash":  # seen by the monitor; codes confirm
            return
        out.cause = cause_of_codes(out.codes, out.max_step)
        if out.cause in ("startup_failure", "process_crash"):
            out.detail = out.detail or f"exit codes {sorted(set(out.codes))}"
        if out.t_detect is None and out.cause not in ("success", "user_error", "preempted"):
            out.t_detect = time.time()

    def _watch(self, hb_dir: Path, attempt: int, out: Outcome, stop: threading.Event) -> None:
        """Poll heartbeats: learn time-outs, drive chaos, catch dead and hung ranks."""
        monitor = HangMonitor(self.timeouts)
        flagged: dict[int, set[int]] = {}
        while not stop.wait(0.05):
            try:
                if self._poll(hb_dir, attempt, out, monitor, flagged):
                    break
            except Exception as e:  # the monitor must outlive any one bad poll
                log.error("monitor poll failed: %s", e)
        # torch's agent waits for a worker's return value: a rank that ended with exit code 0
        # mid-job (os._exit(0) in a user's reward) leaves it waiting for ever. Stop it the way
        # a stop request would, marked as ours, once it has had time to end on its own.
        if not stop.wait(UNSTICK_AFTER_S) and not stop.is_set():
            if self.cluster is not None:  # run_attempt kills the node launchers on `stop`
                stop.set()
            else:
                self.stop_stuck_launcher()

    def stop_stuck_launcher(self) -> None:
        """Ends this host's elastic agent, still waiting UNSTICK_AFTER_S after its attempt's
        fault was named, with a SIGTERM marked as ours (never taken for a preemption)."""
        log.warning("the launcher did not end %g s after the fault (a rank that exits 0 mid-job, "
                    "e.g. os._exit(0) in user code, leaves it waiting): stopping it",
                    UNSTICK_AFTER_S)  # fmt: skip
        self._unstick.set()
        os.kill(os.getpid(), signal.SIGTERM)

    def note_stragglers(self, beats: dict, node_of_rank, now: float,
                        flagged: dict[int, set[int]]) -> None:  # fmt: skip
        """One slow batch is noise; slow in STRAGGLER_STEPS different steps is a straggler,
        recorded once per attempt (the job goes on; the ledger decides about the node)."""
        for r in stragglers(beats, now):
            steps = flagged.setdefault(r, set())
            if len(steps) < STRAGGLER_STEPS:
                steps.add(beats[r].step)
                if len(steps) == STRAGGLER_STEPS:
                    self._record_slow(r, node_of_rank(r), beats[r], now)

    def _poll(self, hb_dir: Path, attempt: int, out: Outcome, monitor, flagged: dict) -> bool:
        """One look at the heartbeats; True once a fault was found and the attempt torn down."""
        now = time.time()
        beats = {r: b for r, b in read_all(hb_dir).items() if b.attempt == attempt}
        self.timeouts.observe(beats.values())
        out.max_step = max([out.max_step, *(b.step for b in beats.values())])
        self.chaos.poll(beats, now, attempt)
        self.note_stragglers(beats, lambda r: node_of(hb_dir, r), now, flagged)
        dead = [
            b
            for b in beats.values()
            if b.phase != "done" and process_state(b.pid) in ("Z", "X", None)
        ]
        hang = None if dead else monitor.check(beats, now)
        if not dead and hang is None:
            return False
        if dead:
            # The culprit is a rank that was killed; ranks that exited with an error (exit file)
            # usually died of losing it, in a collective.
            b = min(dead, key=lambda b: (exit_code(hb_dir, b.rank) is not None, b.rank))
            out.cause, out.rank = "process_crash", b.rank
            out.detail = f"rank {b.rank} died in {phase_words(b.phase)} of step {b.step + 1}"
            if b.step < 0:
                out.cause = "startup_failure"
                out.detail = f"rank {b.rank} died while starting ({b.phase})"
            if any(exit_code(hb_dir, d.rank) == EXIT_USER_ERROR for d in dead):
                out.cause = "user_error"  # it said why in one line; retrying cannot help
            out.cause = user_code_fault(out.cause, b.phase)
            out.t_fault = self.chaos.fault_time(b.rank) or now
        else:
            out.cause, out.rank = user_code_fault("hang", hang.phase), hang.rank
            out.detail = hang.describe()
            out.t_fault = self.chaos.fault_time(hang.rank) or hang.since
            out.limit_s = hang.limit_s
            dump_stacks(beats, self.run_dir / "logs" / f"stacks-attempt{attempt}.txt")
        out.t_detect = now
        out.node = node_of(hb_dir, out.rank)
        for b in beats.values():  # tear the attempt down now: the agent would wait for gloo
            try:
                os.kill(b.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        rc = 1
        try:
            try:
                rc = self._run()
            except StopRequested as e:
                print(f"{self.says} {e}; run the same command again to resume", file=sys.stderr)
                rc = EXIT_PREEMPTED
                if self._hosts() and not self.follows:  # hosts that joined stop with us
                    self.control.abort(f"the coordinator stopped on request: {e}")
            return rc
        except BaseException as e:  # the other hosts' ranks must not wait on ours
            from wanka.train.run_lock import StoppedBeforeStart

            if isinstance(e, ValueError):  # said in one line by the CLI, which exits 2
                rc = EXIT_USER_ERROR
            elif isinstance(e, StoppedBeforeStart):  # the CLI says it and exits 75, so does
                rc = EXIT_PREEMPTED  # the job's recorded code (a batch script requeues on it)
            if self._hosts() and not self.follows:
                self.control.abort(f"the coordinator stopped: {type(e).__name__}: {e}")
            raise
        finally:  # a job that wrote no snapshot (e.g. stopped in pre-flight) leaves no folder
            from wanka.train.run_lock import drop_owner_if_alone

            if self._warm is not None:  # spare launchers of an attempt that never came
                self._warm.close()
            self._announce_end(rc)  # an exception or interrupt ended the loop: say so
            if self._hosts() and not self.follows:
                self._write_job_rc(rc)
            if self.control is not None:
                self.control.close()
            if rc == 0 and self.cluster is not None:
                self._drop_node_snapshots()
            drop_owner_if_alone(Path(self.rc.snapshot_dir) / self.job)

    def _write_job_rc(self, rc: int) -> None:
        """The coordinator's exit code is the job's: the batch script reads it
        (WANKA_JOB_RC_FILE, launch/slurm.py) instead of srun's highest task code."""
        path = os.environ.get("WANKA_JOB_RC_FILE")
        if not path:
            return
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(f"{rc}\n")
        except OSError as e:
            print(f"{self.says} cannot write the job's exit code to {path}: {e}", file=sys.stderr)

    def _drop_node_snapshots(self) -> None:
        """A finished job needs no snapshot: the copies nodes kept of ranks that moved away
        (a hot spare took their node's place) go too, not only the last ranks' own."""
        from wanka.cluster.nodes import node_path

        for n in self.cluster.nodes:
            where = node_path(n, self.rc.snapshot_dir)
            if where is not None:
                shutil.rmtree(where / self.job, ignore_errors=True)

    def _run(self) -> int:
        self._catch_stop_requests()  # first: the import below takes seconds
        import wanka.train.trainer  # noqa: F401  (imported once here, inherited by every fork)

        t_job = time.time()
        self.timeline.event("job", t_job, None, job=self.job, node=self.node)
        summary_before = _file_id(self.run_dir / "summary.json")  # an earlier run's, if any
        self._start_first_launchers()
        if self.rc.preflight != "off":
            rc = self._preflight(live=self.rc.preflight == "full")
            if rc:
                if self.follows:  # the coordinator waits for us at the rendezvous: tell it
                    self.control.leave(rc, "its pre-flight failed (see that node's output)")
                return rc
        attempt, failures, stalled, last_max = 0, 0, 0, -1
        rc = 1
        if self.follows:  # a host (re)started while the job runs joins its next attempt
            first, ended = self.control.join()
            if ended is not None:
                return self._follower_end(ended)
            attempt = first - 1
        while True:
            if self._preempt.is_set():  # a stop request between attempts: resumable
                print(f"{self.says} stopped on request between attempts; run the same command "
                      "again to resume", file=sys.stderr)  # fmt: skip
                rc = EXIT_PREEMPTED
                break
            attempt += 1
            if self.follows and self.control.sits_out(attempt):  # a spare, or evicted
                rc = self._stand_by(attempt)
                if rc is None:
                    continue
                break
            self.attempt = self.timeline.attempt = attempt
            out = self._attempt(attempt)
            if out.cause == "preempted" and _finished(self.run_dir, summary_before,
                                                      self.cfg.train.steps):  # fmt: skip
                # The stop request came after the last step boundary (final save, eval,
                # summary): the ranks ended the job, and nothing is left to resume. Said as a
                # stop before, exit 75 and "run the same command again to resume".
                print(f"{self.says} a stop request came after the job had finished its "
                      f"{self.cfg.train.steps} steps: nothing to resume", file=sys.stderr)  # fmt: skip
                out.cause = "success"
            self.outcomes.append(out)
            if self.follows and out.cause != "preempted" and not self._preempt.is_set():
                nxt = self.control.wait_next(attempt, self._preempt)
                if nxt["action"] == "restart":
                    print(f"{self.says} {nxt['message'] or out.cause}; restart as the "
                          f"coordinator ({self.control.host}) decided", file=sys.stderr,
                          flush=True)  # fmt: skip
                    continue
                rc = self._follower_end(nxt)
                break
            if out.cause == "success":
                rc = 0
                break
            if out.never_met and attempt == 1 and out.max_step < 0 and self.nnodes > 1:
                # The hosts never met (torchrun gives up too): nothing ran, no host to blame.
                where = self.rdzv.get("rdzv_endpoint") or self.rdzv.get("master_addr") or "?"
                print(f"{self.says} the {self.nnodes} hosts never met at the rendezvous at "
                      f"{where} ({out.detail}); nothing was trained: start the same command "
                      "(same --nnodes, --rdzv-endpoint and --rdzv-id) on every host, with the "
                      "endpoint's host up and reachable", file=sys.stderr)  # fmt: skip
                rc = 1
                break
            if out.cause == "user_error":
                # The ranks leave the saying to us: the first rank to exit makes us stop the
                # others at once, possibly before rank 0 had printed anything.
                said = out.said or f"a rank stopped on an input error; see {self.run_dir}/logs"
                print(f"{self.says} {said}", file=sys.stderr)
                rc = EXIT_USER_ERROR
                break
            if out.cause == "preempted" or self._preempt.is_set():
                now = time.time()
                self.timeline.event("fault", self.chaos.sigterm_time or now, now, cause="preempted",
                                    rank=None, node=self.node, detail=out.detail,
                                    injected=self.chaos.sigterm_time is not None)  # fmt: skip
                how = ("after a last-gasp checkpoint" if out.confirmed else
                       "without a last-gasp checkpoint (it resumes from the newest snapshot or checkpoint)")  # fmt: skip
                print(f"{self.says} stopped on request ({out.detail}) {how}; run the same "
                      "command again to resume", file=sys.stderr)  # fmt: skip
                rc = EXIT_PREEMPTED
                break
            if self._repeated(out):
                log_file = rank_logs.log_path(self.run_dir, out.rank)
                what = out.error or f"the same fault ({out.detail})"
                print(f"{self.says} rank {out.rank} failed twice at step {out.max_step + 1} with "
                      f"{what}: not a transient fault, so no more restarts; fix it and run "
                      f"the same command to resume (log {log_file})", file=sys.stderr)  # fmt: skip
                rc = EXIT_USER_ERROR
                break
            evicted = self._record_fault(out, attempt)
            failures += 1
            if self._hosts() and out.cause == "node_lost" and out.node == self.node:
                print(f"{self.says} {self._where(out)}{out.cause} ({out.detail}): this host serves "
                      "the control store, so no restart can reach the others; the job ends here "
                      "(a requeued or resubmitted job resumes from the newest checkpoint)",
                      file=sys.stderr)  # fmt: skip
                break
            # An eviction changes the world the next attempt runs on: earlier attempts that made
            # no progress on the evicted node say nothing about it.
            stalled = 0 if evicted else stalled + 1 if out.max_step <= last_max else 0
            last_max = max(last_max, out.max_step)
            if failures > self.rc.max_restarts:
                print(f"{self.says} giving up after {failures} faults (resilience.max_restarts="
                      f"{self.rc.max_restarts}); last: {out.cause}: {out.detail}", file=sys.stderr)  # fmt: skip
                break
            if stalled >= self.rc.no_progress_restarts:
                print(f"{self.says} {stalled} restarts in a row made no progress (last: "
                      f"{out.cause}: {out.detail}); fix the cause and resume", file=sys.stderr)  # fmt: skip
                break
            delay = 0.0 if stalled == 0 else min(self.rc.backoff_s * 2 ** (stalled - 1),
                                                 self.rc.backoff_max_s)  # fmt: skip
            why = (
                f": {out.error} (see {rank_logs.log_path(self.run_dir, out.rank)})"
                if out.error
                else ""
            )
            print(f"{self.says} {self._where(out)}{out.cause} ({out.detail}{why}); restart {failures} in {delay:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            self._preempt.wait(delay)  # a stop request ends the back-off at once
            if self._hosts() and not self._preempt.is_set():  # which hosts train next
                self._plan_hosts(attempt + 1, out)
            if self.rc.preflight != "off" and self._preflight(live=False):
                rc = EXIT_USER_ERROR  # e.g. the remaining nodes cannot hold this layout
                break
            if self._preempt.is_set():
                continue  # the loop's top ends the job (75): no restart to announce
            if self._hosts():
                self.control.announce(attempt, "restart", message=f"{self._where(out)}"
                                      f"{out.cause} ({out.detail})")  # fmt: skip
            self.timeline.event(
                "restart", out.t_detect or time.time(), time.time(), cause=out.cause
            )
        self._announce_end(rc)
        self.chaos.close()  # a drill's full disk never outlives the job
        self.timeline.event("job", t_job, time.time(), job=self.job, node=self.node, rc=rc)
        # Whenever rank 0 finished (its summary names the picture), even if the job then ended
        # non-zero (stopped or a peer lost at the last barrier).
        if self.draws_loss_curve and _file_id(self.run_dir / "summary.json") != summary_before:
            self._draw_loss_curve()
        return rc

    def _stand_by(self, attempt: int) -> int | None:
        """A follower not among `attempt`'s hosts waits for the coordinator's next word: None
        to go on to the next attempt, or the job's exit code."""
        plan = self.control.plans[attempt]
        why = ("evicted" if self.node in self.control.evicted_now else
               "a hot spare" if self.control.spares else "not in this attempt")  # fmt: skip
        print(f"{self.says} node {self.node} stands by ({why}) while attempt {attempt} trains on "
              f"{', '.join(plan)}", file=sys.stderr, flush=True)  # fmt: skip
        nxt = self.control.wait_next(attempt, self._preempt)
        if nxt["action"] == "restart":
            return None
        return self._follower_end(nxt)

    def _plan_hosts(self, attempt: int, out: Outcome) -> None:
        """The coordinator: the hosts of the next attempt, said when they change."""
        after = self.control.plan(attempt, out.cause, out.node)
        before = self.control.plans.get(attempt - 1)
        step = self.control.snapshot_step.get(attempt)
        source = (f"the in-memory snapshots of step {step}" if step is not None else
                  "the newest checkpoint (no host set holds a snapshot of every rank)")  # fmt: skip
        if before is not None and after != before:
            gone = [h for h in before if h not in after]
            new = [h for h in after if h not in before]
            how = (f"{', '.join(new)} takes the place of {', '.join(gone)}" if new and gone else
                   f"continuing without {', '.join(gone)}" if gone else f"adding {', '.join(new)}")  # fmt: skip
            print(f"{self.says} next attempt on {', '.join(after)}: {how}; the ranks resume "
                  f"from {source}", file=sys.stderr, flush=True)  # fmt: skip
        else:
            log.info("next attempt on %s; the ranks resume from %s", ", ".join(after), source)

    def _announce_end(self, rc: int) -> None:
        """The coordinator tells the others the job ended (once; also after an exception)."""
        if not self._hosts() or self.follows or getattr(self, "_ended", False):
            return
        self._ended = True
        last = self.outcomes[-1] if self.outcomes else None
        why = f"{last.cause}: {last.detail}" if last is not None else "before its first attempt"
        self.control.announce(max(self.attempt, 1), "end", rc, why)

    def _follower_end(self, nxt: dict) -> int:
        """The job ends on the coordinator's word (or, with no coordinator left, on ours)."""
        rc = int(nxt["rc"])
        if nxt.get("own"):
            print(f"{self.says} {nxt['message']}", file=sys.stderr)
        elif rc:
            print(f"{self.says} the coordinator ({self.control.host}) ended the job (exit {rc}): "
                  f"{nxt['message']}", file=sys.stderr)  # fmt: skip
        return rc

    def _where(self, out: Outcome) -> str:
        """With the control store the fault's node is known for sure: said first."""
        if self.control is None and out.cause != "node_lost":
            return ""
        from wanka.resilience.store_attempt import where

        return where(out)

    def _draw_loss_curve(self) -> None:
        from wanka.report import plot_loss_curves

        try:
            plot_loss_curves(self.run_dir)
        except Exception as e:  # the run trained: a missing picture is not a failure
            print(f"{self.says} loss curve not drawn: {e}", file=sys.stderr)

    def _repeated(self, out: Outcome) -> bool:
        """The same exception at the same step as the attempt before, or the job's own code
        failing (dying or hanging) again at the same step: deterministic (a bug or bad input),
        which a restart cannot fix. Injected faults leave no exception."""
        # A user_code hang is time over a learned limit: a slow but honest step may overrun
        # again, so only a death in the job's own code counts as deterministic.
        user_death = out.cause == "user_code" and out.limit_s is None
        if len(self.outcomes) < 2 or not (out.error or user_death):
            return False
        prev = self.outcomes[-2]
        key = ("error", "max_step", "rank") if out.error else ("cause", "max_step", "rank")
        return all(getattr(prev, k) == getattr(out, k) for k in key)

    def _record_fault(self, out: Outcome, attempt: int) -> bool:
        """Record the fault in the timeline and ledger; True when it got a node evicted."""
        t1 = out.t_detect or time.time()
        if out.limit_s is None and out.cause in ("hang", "node_lost"):
            # Named without a culprit phase (a node's launcher or agent killed): the longest
            # learned limit of a step's phases, as its silence would have been judged mid-step
            # (a save to disk, with its 30 s floor, would allow more: this is the stricter).
            learned = [self.timeouts.limit(p) for p in TRAIN_PHASES if p in self.timeouts.learned]
            out.limit_s = max(learned) if learned else None
        self.timeline.event("fault", out.t_fault or t1, t1, cause=out.cause, rank=out.rank,
                            node=out.node or self.node, detail=out.detail, limit_s=out.limit_s,
                            injected=self.chaos.fault_time(out.rank, out.node) is not None)  # fmt: skip
        node = out.node or self.node
        injected = self.chaos.fault_time(out.rank, out.node) is not None
        try:
            self.ledger.record(self.job, node, out.rank, out.cause, out.max_step, out.detail,
                               injected=injected)  # fmt: skip
            reason = self.ledger.evaluate(node, self.policy)
        except ValueError as e:  # (a full disk, say): the job goes on, its fault said above
            self._ledger_failed(e)
            return False
        if not reason:
            return False
        width = self.width if self.cluster else self.control.width if self._hosts() else 1
        if self.cluster:
            left = [n for n in self.active_nodes() if n.name != node]
        elif self._hosts() and node != self.node:  # the coordinator's own host stays: it
            left = self.control.others(node)  # hosts torchrun's rendezvous store
        else:
            left = []
        if left and not self._fits(min(len(left), width)):
            print(f"{self.says} node {node} meets the eviction policy ({reason}) but "
                  f"{min(len(left), width)} node(s) cannot hold parallel.dp_shard={self.cfg.parallel.dp_shard} "
                  f"x cp={self.cfg.parallel.cp} with ep={self.cfg.parallel.ep}: kept", file=sys.stderr)  # fmt: skip
        elif left:
            self.ledger.evict(node, reason)
            left = (
                ", ".join(n.name for n in self.attempt_nodes())
                if self.cluster
                else "the other hosts (a hot spare in its place, if one stands by)"
            )
            print(f"{self.says} evicting node {node} ({reason}); continuing on {left}",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.timeline.event("evict", time.time(), time.time(), node=node, reason=reason)
            return True
        elif self._hosts() and node == self.node and node not in self.ledger.evicted():
            # Evicted in the ledger (the next `wanka launch` excludes it), but it trains on in
            # this job: the control and rendezvous stores run on it.
            self.ledger.evict(node, reason)
            print(f"{self.says} evicting node {node} ({reason}) from the next submission; it "
                  "coordinates this job (the control and rendezvous stores run on it), so it "
                  "trains on until the job ends", file=sys.stderr, flush=True)  # fmt: skip
            self.timeline.event("evict", time.time(), time.time(), node=node, reason=reason)
        elif node not in self._warned and not (self._hosts() and node == self.node):
            self._warned.add(node)
            print(f"{self.says} node {node} meets the eviction policy ({reason}) but no other "
                  "node is left: kept; see `wanka nodes`", file=sys.stderr)  # fmt: skip
        return False

    def _record_slow(self, rank: int, node: str | None, beat, now: float) -> None:
        node = node or self.node
        detail = f"rank {rank} spent {now - beat.since:.2f} s loading data for step {beat.step + 1}"
        injected = self.chaos.injected_inside("slow", rank)
        self.timeline.event("fault", beat.since, now, cause="slow", rank=rank, node=node,
                            detail=detail, injected=injected)  # fmt: skip
        try:
            self.ledger.record(self.job, node, rank, "slow", beat.step, detail, injected=injected)
        except ValueError as e:
            print(f"{self.says} straggler: {detail} (node {node})", file=sys.stderr, flush=True)
            self._ledger_failed(e)
            return
        print(f"{self.says} straggler: {detail} (node {node}); recorded in the fault ledger",
              file=sys.stderr, flush=True)  # fmt: skip

    def _ledger_failed(self, e: ValueError) -> None:
        """A fault the ledger could not take is not a reason to end the job (whose fault was
        already named): said once per problem, the job goes on without counting it."""
        if str(e) not in self._warned:
            self._warned.add(str(e))
            print(f"{self.says} not recorded: {e}; the job goes on (this fault does not count "
                  "toward evicting its node)", file=sys.stderr, flush=True)  # fmt: skip

    def _preflight(self, live: bool) -> int:
        from wanka.resilience.preflight import preflight

        nnodes = (len(self.attempt_nodes()) if self.cluster is not None else
                  self.control.nnodes(self.attempt + 1) if self._hosts() else self.nnodes)  # fmt: skip
        t0 = time.time()
        report = preflight(self.cfg, self.nproc, nnodes=nnodes, live=live, rdzv=self.rdzv)
        self.timeline.event("preflight", t0, time.time(), ok=report.ok)
        if not report.ok:  # one line per failed check, each saying what to fix
            for r in report.results:
                if not r.ok:
                    print(f"{self.says} pre-flight {r.name}: {r.message}", file=sys.stderr)
            return EXIT_USER_ERROR
        return 0
