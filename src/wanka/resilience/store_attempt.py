"""resilience.control = "store": a --cluster supervisor that watches its ranks through the
control plane (wanka/control/) instead of the shared run directory's heartbeat files.

* The control store (a TCPStore) is a process on one node, its *home* (node 0 to begin with):
  `python -m wanka.control.store_server`, started inside the node, so it dies with it. The
  supervisor reaches it as a client from a thread that entered the home's network namespace
  (the cluster's bridge has no address: nothing inside a node can reach the host's own
  namespace, nor the host a node's, except from inside). A standby store idles on another
  node. Agents learn the store's address with their orders, so the next attempt's warm
  launchers serve whichever store it uses. If the home is lost (its store process dies: a node
  kill, a lost host) or is the node the last fault was named on, the next attempt runs on the
  standby, its ranks restoring from their peers' snapshots.
* Each node runs a node agent (python -m wanka.control.agent ... -- torchrun ...) inside its
  namespace: torchrun is its child, in a process group the agent kills on a stop decision, or
  by itself when the store has been unreachable for AGENT_TIMEOUT_S (its coordinator is gone:
  the node fences itself rather than train on alone). The node's ranks write their heartbeats
  to a folder only that node's agent reads: in the node's private memory
  (NODE_LOCAL/JOB/NODE/attemptN, see cluster/nodes.py), or on a cluster made before nodes had
  one, RUN_DIR/resilience/nodes/NODE/attemptN.
* A Coordinator names the fault from the store alone (rank, node, cause) and writes the stop
  decision; restarts, back-off and eviction are the supervisor's, as in the default mode.

Each attempt has its own key space (wanka/JOB/aN/): registrations, exits and decisions of an
earlier attempt can never be mistaken for this one's.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from wanka.cluster.state import NODE_LOCAL
from wanka.control.coordinator import Coordinator
from wanka.control.store import ControlStore
from wanka.resilience.cluster_attempt import Reapers
from wanka.resilience.heartbeat import exit_code, exit_message
from wanka.resilience.monitor import kill_marked

log = logging.getLogger("wanka.supervisor")
CLONE_NEWNET = 0x40000000
AGENT_POLL_S = 0.1
AGENT_TIMEOUT_S = 10.0  # an agent this long without a beat: its node is lost
STOP_GRACE_S = 5.0  # after a stop decision, the attempt is torn down from here if still up
WITNESS_S = 1.0  # a spare's connection attempt to the store, when asked to witness
STORE_START_S = 60.0  # for the store's process to say its port (it imports torch)
T = TypeVar("T")


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """fn() run by a thread that entered network namespace `netns` (/run/netns/NAME): the
    sockets it makes live there; this process's other threads stay put."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise ConnectionError(f"cannot enter {netns}: {os.strerror(err)} (root?)")
            finally:
                os.close(fd)
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001  (said by the caller as a ConnectionError)
            box["error"] = e

    t = threading.Thread(target=run, name="wanka-control-netns")
    t.start()
    t.join()
    if "error" in box:
        raise ConnectionError(str(box["error"]))
    return box["value"]  # type: ignore[return-value]


class StoreProcess:
    """A control store's process on a node, and this process's client of it once it said its
    port (attach)."""

    def __init__(self, node, proc: subprocess.Popen) -> None:
        self.node, self.proc = node, proc
        self.client: ControlStore | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def attach(self, job: str, timeout_s: float = STORE_START_S) -> ControlStore | None:
        """Our client, once the store said its port within `timeout_s`; None if it has not yet
        (with `wait=False` semantics: timeout_s 0 never blocks)."""
        if self.client is not None:
            return self.client
        node, proc = self.node, self.proc
        ready = select.select([proc.stdout], [], [], timeout_s)[0]
        if not ready and timeout_s == 0 and proc.poll() is None:
            return None  # still importing: ask again later
        said = json.loads(proc.stdout.readline() or "{}") if ready else {}
        if "port" not in said:
            gone = proc.poll()
            why = said.get("error") or (
                f"its process exited ({gone}) before serving" if gone is not None
                else f"no answer within {timeout_s:.0f} s")  # fmt: skip
            raise ConnectionError(f"control store on {node.name} ({node.addr}): {why}")
        port = int(said["port"])
        self.client = in_netns(node.netns, lambda: ControlStore.connect(node.addr, port, job))
        return self.client


def spawn_store(node) -> StoreProcess:
    """Start the control store's process on `node`, in a session of its own (a signal to the
    supervisor's process group, a terminal's Ctrl-C, is not for it: it ends when its stdin
    closes, or with its node). It imports torch: attach() waits for its port."""
    from wanka.cluster import nodes as nd

    try:
        proc = nd.popen(node, [sys.executable, "-m", "wanka.control.store_server", "--host",
                               node.addr], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True, start_new_session=True)  # fmt: skip
    except (ValueError, OSError) as e:  # e.g. the node is down
        raise ConnectionError(f"control store on {node.name}: {e}") from None
    return StoreProcess(node, proc)


def start_store(node, job: str) -> StoreProcess:
    """spawn_store + attach; nothing left behind on failure."""
    store = spawn_store(node)
    try:
        store.attach(job)
    except (ConnectionError, ValueError) as e:
        stop_store(store.proc)
        raise ConnectionError(str(e)) from None
    return store


def stop_store(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()  # it exits on EOF
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class StoreControl:
    """The supervisor's side of the control plane, one per job; `sup` is the Supervisor."""

    def __init__(self, sup) -> None:
        self.sup = sup
        self.primary: StoreProcess | None = None  # the store this attempt uses
        # A second store on another node, idle: a lost primary is replaced at once.
        self.standby: StoreProcess | None = None
        self.store: ControlStore | None = None
        self.coordinator: Coordinator | None = None
        self.attempt, self.world = 0, 0
        self.nodes: list[str] = []
        self._stop_event = threading.Event()  # the current attempt's: set by watch()
        self._reapers = Reapers("wanka-store-reaper")

    def _stop_later(self, st: StoreProcess) -> None:
        """Stop a store no one will use again without waiting for it: a store process that
        imported torch takes ~0.5 s to exit, which the next attempt's start-up would wait."""
        proc = st.proc
        self._reapers.run(lambda: stop_store(proc))

    def hb_dir(self, node: str, attempt: int | None = None, host: bool = False) -> Path:
        """Node `node`'s own heartbeat folder for an attempt, as its processes see it (`host`:
        where the host sees it, for clean-up and a post-mortem when the store is gone)."""
        name = f"attempt{attempt or self.attempt}"
        root = self.sup.cluster.node(node).root
        if not root:
            return self.sup.dir / "nodes" / node / name
        return Path(root) / "local" / self.sup.job / node / name if host else (
            Path(NODE_LOCAL) / self.sup.job / node / name)  # fmt: skip

    @property
    def server(self) -> ControlStore:
        return self.primary.client

    @property
    def server_proc(self) -> subprocess.Popen | None:
        return self.primary.proc if self.primary is not None else None

    @property
    def home(self):
        return self.primary.node

    def begin(self, attempt: int, nodes: list, spare_nodes: list = ()) -> None:
        """Before attempt `attempt` starts on `nodes`; `spare_nodes`: hot spares, where a store
        may live too (the standby prefers one: no ranks to compete with, no rank's fault).
        Launchers learn the store with their orders (`orders`), so whichever store serves the
        attempt, the warm ones started ahead of it stay usable."""
        names = [n.name for n in [*nodes, *spare_nodes]]

        def usable(st: StoreProcess | None) -> bool:
            return st is not None and st.alive() and st.node.name in names

        old = self.primary
        lost = old is not None and not old.alive()
        # Never on the node the last fault was named on (a cut link, a frozen host: its store
        # process may look alive and be unreachable).
        faulted = self.sup.outcomes[-1].node if self.sup.outcomes else None
        if self.standby is not None and self.standby.node.name == faulted:
            self._stop_later(self.standby)
            self.standby = None
        if old is None or not usable(old) or old.node.name == faulted:
            if old is not None:
                self._stop_later(old)
            if usable(self.standby) and self._attach(self.standby):
                self.primary, self.standby = self.standby, None
            else:
                self.primary = self._start_on(
                    [*nodes, *spare_nodes], avoid=(old.node.name if old else None, faulted)
                )
        if old is not None and self.primary is not old:
            log.warning("control store moved from %s to %s (%s:%d)%s", old.node.name,
                        self.home.name, self.home.addr, self.server.port,
                        "" if lost else " (its node was named in the last fault)")  # fmt: skip
        self._keep_standby([*spare_nodes, *nodes], spawn=False)  # spawned once training
        s = self.server
        self.attempt, self.world = attempt, self.sup.nproc * len(nodes)
        self.nodes = [n.name for n in nodes]  # watched: the attempt's, never a spare
        self.store = ControlStore(s.store, s.host, s.port, f"{self.sup.job}/a{attempt}")
        self.coordinator = Coordinator(self.store, self.world, self.sup.timeouts,
                                       AGENT_TIMEOUT_S, attempt=attempt, nodes=self.nodes,
                                       home=self.home.name,
                                       witness=self._witness(spare_nodes))  # fmt: skip
        for n in nodes:  # a run directory reused by a new job may hold this attempt's folder
            shutil.rmtree(self.hb_dir(n.name, host=True), ignore_errors=True)

    def _witness(self, spare_nodes: list):
        """A node outside the attempt (a hot spare) that says whether it reaches the store
        now: with one other training node, it tells the store node's cut link from that
        node's loss (Coordinator._witnessed_cut). None without a spare."""
        home = self.home
        spares = [n for n in spare_nodes if n.name != home.name]
        if not spares:
            return None
        node, addr, port = spares[0], home.addr, self.server.port

        def reaches() -> tuple[str, bool]:
            def connect() -> bool:
                try:
                    socket.create_connection((addr, port), timeout=WITNESS_S).close()
                    return True
                except OSError:
                    return False

            try:
                return node.name, in_netns(node.netns, connect)
            except ConnectionError:  # cannot enter its namespace: no word from it
                return node.name, True

        return reaches

    def _attach(self, st: StoreProcess, timeout_s: float = STORE_START_S) -> bool:
        """Our client of `st` (False: not ready within timeout_s 0, or dead and dropped)."""
        try:
            return st.attach(self.sup.job, timeout_s) is not None
        except (ConnectionError, ValueError) as e:
            log.error("%s", e)
            self._stop_later(st)
            if st is self.standby:
                self.standby = None
            return False

    def _start_on(self, nodes: list, avoid: tuple) -> StoreProcess:
        """A store on the first of `nodes` that can serve one; nodes in `avoid` (the one that
        just lost it, the last fault's) last."""
        order = [n for n in nodes if n.name not in avoid] + [n for n in nodes if n.name in avoid]
        errors = []
        for node in order:
            try:
                return start_store(node, self.sup.job)
            except ConnectionError as e:
                errors.append(str(e))
                log.error("%s; trying the next node", e)
        raise ValueError(f"resilience.control = store: no node could serve the control "
                         f"store: {'; '.join(errors)}")  # fmt: skip

    def when_training(self, nodes: list) -> None:
        """The attempt's ranks train (run_attempt): start the standby store now, not under
        their start-up, whose imports its own import would slow (spares first in `nodes`)."""
        spares = [n for n in nodes if n.name not in self.nodes]
        self._keep_standby([*spares, *(n for n in nodes if n not in spares)])

    def _keep_standby(self, nodes: list, spawn: bool = True) -> None:
        """A standby store on another node than the primary's (none with one node), the first
        of `nodes` that can serve one; `spawn` False: only drop one that can no longer serve."""
        st = self.standby
        if st is not None and (not st.alive() or st.node.name not in {n.name for n in nodes}):
            self._stop_later(st)
            self.standby = None
        if self.standby is None and spawn:
            faulted = self.sup.outcomes[-1].node if self.sup.outcomes else None
            others = [n for n in nodes if n.name != self.home.name]
            for node in [n for n in others if n.name != faulted] + [
                n for n in others if n.name == faulted
            ]:
                try:
                    self.standby = spawn_store(node)
                    return
                except ConnectionError as e:
                    log.error("%s (no standby store there)", e)

    def close(self) -> None:
        for st in (self.primary, self.standby):
            if st is not None:
                stop_store(st.proc)
        self.primary = self.standby = None
        self._reapers.join()  # no store outlives the supervisor

    # -- the launcher hooks of cluster_attempt.run_attempt ---------------------------------
    def command(self, node, argv: list[str], attempt: int) -> list[str]:
        """`argv` run by node `node`'s agent for `attempt` (started ahead of it when warm); the
        agent takes the store's address from its orders (`orders`)."""
        return [sys.executable, "-m", "wanka.control.agent", "--store-from-orders", "--job",
                f"{self.sup.job}/a{attempt}", "--node", node.name,
                "--hb-dir", str(self.hb_dir(node.name, attempt)), "--poll-s", str(AGENT_POLL_S),
                "--attempt", str(attempt), "--orphan-s", str(AGENT_TIMEOUT_S),
                "--timeout-s", str(AGENT_TIMEOUT_S / 2),
                "--stacks-dir", str(self.sup.run_dir / "logs"), "--", *argv]  # fmt: skip

    def own_run_dir(self) -> Path | None:
        """With WANKA_NODE_OWN_RUN_DIR=1 (a test of the claim that only checkpoints cross the
        shared filesystem) each node's launcher sees its own run directory but for its
        checkpoints folder (cluster/nodes.py)."""
        from wanka.cluster.nodes import OWN_RUN_DIR_ENV

        return self.sup.run_dir if os.environ.get(OWN_RUN_DIR_ENV) == "1" else None

    def orders(self, orders: dict) -> dict:
        """A launcher's orders with the address of the store serving this attempt."""
        s = self.server
        return {**orders, "store": {"host": s.host, "port": s.port}}

    def env(self, node, env: dict[str, str], attempt: int) -> dict[str, str]:
        hb = self.hb_dir(node.name, attempt)  # the node's own: its agent publishes it all
        return {**env, "WANKA_HB_DIR": str(hb), "WANKA_CHAOS_MARKS": str(hb / "chaos")}

    def kill(self, node: str, _p: subprocess.Popen) -> None:
        """The end of a node's attempt, whatever its agent managed."""
        kill_marked(f"WANKA_HB_DIR={self.hb_dir(node)}")

    # -- watching ---------------------------------------------------------------------------
    def watch(self, _hb_dir: Path, attempt: int, out, stop: threading.Event) -> None:
        """The supervisor's monitor thread in this mode: chaos, stragglers, and faults as the
        coordinator names them."""
        flagged: dict[int, set[int]] = {}
        self._stop_event = stop
        while True:
            last = stop.wait(0.05)  # a last look after the attempt ended: a node's torchrun
            try:  # may exit on a crash before the coordinator named it
                if self._poll(attempt, out, flagged, final=last) or last:
                    return
            except ConnectionError as e:
                log.error("control store: %s", e)
            except Exception as e:  # the monitor must outlive any one bad poll
                log.error("monitor poll failed: %s", e)
            if last:
                return

    def _poll(self, attempt: int, out, flagged: dict[int, set[int]], final: bool = False) -> bool:
        sup, now = self.sup, time.time()
        if self.server_proc.poll() is not None and not final:
            return self._store_lost(out, now)  # (at the final look the attempt is over)
        reports = {r: rep for r, rep in self.store.read_ranks(self.world).items()
                   if rep.beat.attempt == attempt}  # fmt: skip
        beats = {r: rep.beat for r, rep in reports.items()}
        out.max_step = max([out.max_step, *(b.step for b in beats.values())])
        # Chaos signals the ranks by pid: the cluster-in-a-box's nodes share one pid space.
        sup.chaos.poll(beats, now, attempt, node_of=lambda r: getattr(reports.get(r), "node", None))
        sup.note_stragglers(beats, lambda r: reports[r].node, now, flagged)
        if ids := sup.chaos.inside_ids():  # a drill's nan/slow faults that fired, per node
            sup.chaos.note_fired(self.store.read_chaos(ids))
        fault = self.coordinator.check(now, final=final)
        if fault is None:
            return False
        fault.onto(out, now, sup.chaos.fault_time(fault.rank, fault.node))
        # Each agent kills its ranks; after a hang, it writes their stacks first.
        self.coordinator.decide_stop(attempt, fault.describe(), dump=fault.cause == "hang")
        # Should no agent act on it (its store link broken, itself stuck), the attempt is torn
        # down from here after a grace: peers must not wait on gloo until its time-out.
        timer = threading.Timer(STOP_GRACE_S, self._stop_event.set)
        timer.daemon = True
        timer.start()
        return True

    def _store_lost(self, out, now: float) -> bool:
        """The store's process ended: no decision can be written, the attempt is torn down here.
        Killed by SIGKILL (as everything on a node that went: a node kill, a lost host) names
        its node lost; any other end (a crash, an OOM kill's exit) is the store's own fault,
        not held against the node."""
        code, node = self.server_proc.returncode, self.home.name
        try:
            how = signal.Signals(-code).name if code < 0 else f"exit code {code}"
        except ValueError:
            how = f"signal {-code}"
        if code == -signal.SIGKILL:
            out.cause, out.detail = "node_lost", f"the control store on it was killed ({how})"
        else:
            out.cause, out.detail = "process_crash", f"the control store's process ended ({how})"
        out.rank, out.node = None, node
        out.t_fault = self.sup.chaos.fault_time(None, node) or now
        out.t_detect = now
        self._stop_event.set()
        return True

    def exit_marks(self) -> dict[int, tuple[int, str]]:
        """Rank -> (exit code, message) of the ranks that exited on purpose this attempt."""
        if self.store is None:
            return {}
        try:
            return {r: (e.code, e.message) for r, e in self.store.read_exits(self.world).items()}
        except (ConnectionError, RuntimeError) as e:  # the store went with node 0: the files
            log.error("control store: %s; reading exit marks from the node folders", e)
        marks = {}
        for node in self.nodes:
            folder = self.hb_dir(node, host=True)
            for p in folder.glob("rank*.exit"):
                rank = int(p.stem.removeprefix("rank"))
                code = exit_code(folder, rank)
                if code is not None:
                    marks[rank] = (code, exit_message(folder, rank) or "")
        return marks


def where(out) -> str:
    """ "rank R on node N: " (or "node N: ") for the supervisor's line about a fault."""
    if out.node is None:
        return ""
    return f"node {out.node}: " if out.rank is None else f"rank {out.rank} on node {out.node}: "
