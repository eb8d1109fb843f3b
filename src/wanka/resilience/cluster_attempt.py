"""One attempt of a supervised job across the cluster-in-a-box: a launcher on every healthy node.

The supervisor (resilience/supervisor.py) decides which nodes take part (evicted ones do not)
and watches every rank's heartbeat; this module gives each chosen node's launcher
(resilience/node_launch.py: torch's elastic agent in-process, ranks forked after the imports)
its orders, all meeting at torchrun's static rendezvous on the first chosen node (node i of the
attempt is node rank i), waits, and tears
the attempt down as soon as one node fails so the others do not wait on a dead peer. While an
attempt runs, the next attempt's launchers are started and import torch and wanka (WarmLaunchers),
so a restart does not pay two interpreter starts and imports per node before its first step.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wanka.cluster import nodes as nd
from wanka.cluster.launch import RDZV_PORT, torchrun_options
from wanka.cluster.state import ClusterState, Node

log = logging.getLogger("wanka.supervisor")

# Start the next attempt's launchers once this attempt's ranks are training (not during their
# start-up, whose imports and rendezvous they would slow on a busy host), or after this long.
PREWARM_AFTER_S = 30.0


def start_launcher(
    node: Node, attempt: int, log_dir: Path | None, launcher=None
) -> subprocess.Popen:
    """A node launcher for `attempt` inside `node`, importing, waiting for its orders on stdin.
    `launcher` (resilience.control = "store") wraps it in the node's agent."""
    argv = [sys.executable, "-m", "wanka.resilience.node_launch"]
    env = dict(os.environ)
    if launcher is not None:
        argv, env = launcher.command(node, argv, attempt), launcher.env(node, env, attempt)
    out = subprocess.DEVNULL
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        # Appended: a dismissed launcher of the same attempt and node may still be exiting.
        out = open(log_dir / f"{node.name}-attempt{attempt}.log", "a")  # noqa: SIM115
    own = getattr(launcher, "own_run_dir", None)  # the testbed without a shared run dir
    return nd.popen(node, argv, env=env, stdin=subprocess.PIPE, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    own_run_dir=own() if own else None)  # fmt: skip


class Reapers:
    """Threads that end processes no one waits for (a process that imported torch takes
    ~0.5-1 s to exit, which a restart must not wait); `join` before the supervisor exits."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: list[threading.Thread] = []

    def run(self, fn: Callable[[], object]) -> None:
        self.threads = [t for t in self.threads if t.is_alive()]
        thread = threading.Thread(target=fn, name=self.name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        self.threads = []


class WarmLaunchers:
    """Launchers started ahead of the attempt that will use them, per (attempt, node)."""

    def __init__(self, log_dir: Path | None, launcher=None) -> None:
        self.log_dir, self.launcher = log_dir, launcher
        self.ready: dict[tuple[int, str], subprocess.Popen] = {}
        self._reapers = Reapers("wanka-launcher-reaper")

    def prepare(self, attempt: int, nodes: list[Node]) -> None:
        """Start `attempt`'s launchers on `nodes` (an optimisation: a node that cannot start
        one is warned about and left to start cold, the others still get theirs)."""
        for node in nodes:
            if (attempt, node.name) in self.ready:
                continue
            try:
                self.ready[attempt, node.name] = start_launcher(node, attempt, self.log_dir,
                                                                self.launcher)  # fmt: skip
            except (OSError, ValueError) as e:
                log.warning("could not start a launcher for attempt %d on %s ahead of it: %s",
                            attempt, node.name, e)  # fmt: skip

    def retire(self, attempt: int, nodes: list[Node]) -> None:
        """Let go of spares no one will use: older attempts', and this attempt's for nodes not
        in it (evicted since they were started)."""
        names = {n.name for n in nodes}
        self._dismiss_all(
            [k for k in self.ready if k[0] < attempt or (k[0] == attempt and k[1] not in names)],
            wait=False,
        )

    def discard(self, node: str) -> None:
        """A node-level fault was just named on `node`: its spare (its agent's store link, its
        state) is not to be trusted; the next attempt starts a fresh one."""
        self._dismiss_all([k for k in self.ready if k[1] == node], wait=False)

    def _dismiss_all(self, keys: list[tuple[int, str]], wait: bool = True) -> None:
        """`wait=False`: reaped on a thread of its own. Between attempts the next one must not
        wait for them: a launcher that imported torch takes ~1 s to exit."""
        spares = [self.ready.pop(k) for k in keys]
        for p in spares:  # stdin first for all, then wait: at most one grace, not one each
            _close_stdin(p)
        if not spares:
            return
        if wait:
            for p in spares:
                _dismiss(p)
            return
        self._reapers.run(lambda: [_dismiss(p) for p in spares])

    def take(self, attempt: int, node: Node) -> subprocess.Popen:
        """This attempt's launcher for `node`: the warm one if it is still alive (a node_kill
        takes it with the node), else a cold one."""
        p = self.ready.pop((attempt, node.name), None)
        if p is not None and p.poll() is None:
            return p
        if p is not None:
            _dismiss(p)
        return start_launcher(node, attempt, self.log_dir, self.launcher)

    def close(self) -> None:
        self._dismiss_all(list(self.ready))
        self._reapers.join()  # none left behind when the supervisor exits


def _close_stdin(p: subprocess.Popen) -> None:
    try:
        p.stdin.close()
    except OSError:
        pass


def _dismiss(p: subprocess.Popen) -> None:
    """End a launcher that got no orders: closing its stdin makes it exit (and its agent)."""
    try:
        _close_stdin(p)
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _give_orders(p: subprocess.Popen, orders: dict) -> bool:
    try:
        p.stdin.write((json.dumps(orders) + "\n").encode())
        p.stdin.close()
        return True
    except OSError:  # it died between take() and now
        return False


# Faults that make a node suspect (gone, cut off, frozen): a hot spare takes its place. A rank
# that crashed or a failed save says nothing about its node; moving would cost its ranks their
# local snapshots for nothing.
SUSPECT_CAUSES = ("node_lost", "hang")


def choose_nodes(active: list[Node], prev: list[str], width: int,
                 suspect: str | None = None) -> list[Node]:  # fmt: skip
    """The nodes of the next attempt: the previous attempt's, except that a spare (an active
    node not in it) takes the place of the `suspect` one and of any no longer active (evicted);
    the first hosts the rendezvous. Node i is node rank i (a static rendezvous): a spare runs
    the ranks of the node it replaces and every other node keeps its own, so their ranks find
    their own snapshots (a moved rank restores from the copies its new node holds or fetches
    them, resilience/snapshot.py). Without a spare a
    suspect node stays (it may be back) and an evicted one is dropped (the job shrinks)."""
    by_name = {n.name: n for n in active}
    spares = [n for n in active if n.name not in prev and n.name != suspect]
    chosen: list[Node] = []
    for name in prev:
        if name in by_name and name != suspect:
            chosen.append(by_name[name])
        elif spares:
            chosen.append(spares.pop(0))
        elif name == suspect and name in by_name:
            chosen.append(by_name[name])
    while len(chosen) < width and spares:  # the first attempt; or grown back to width
        chosen.append(spares.pop(0))
    if len(chosen) < width and suspect in by_name and by_name[suspect] not in chosen:
        chosen.append(by_name[suspect])
    return chosen[:width]


@dataclass
class AttemptEnd:
    codes: list[int]  # exit codes of the node launchers, in node order, after the teardown
    failed: str | None  # the node that failed first (a killed launcher before one that exited)
    own_code: int | None  # that node's launcher's code before we tore anything down, or None
    t_failed: float | None  # when that was seen


def _first_failure(procs: dict[str, subprocess.Popen]) -> tuple[str | None, int | None]:
    """The node whose launcher failed on its own, as seen now: a launcher killed by a signal
    (its node went) before one that exited non-zero (whose ranks may have died of that)."""
    failed = [(n, p.returncode) for n, p in procs.items() if p.returncode not in (None, 0)]
    if not failed:
        return None, None
    return min(failed, key=lambda nc: nc[1] >= 0)  # stable: node order among equals


def _prepare_next(warm: WarmLaunchers, launcher, attempt: int, nodes: list[Node],
                  start_method: str, prewarm: bool = True) -> None:  # fmt: skip
    """Once the attempt trains: what the next one may need, started now rather than under
    this one's start-up (the control store's standby; the warm launchers, fork only, unless
    `prewarm` is off)."""
    if launcher is not None and hasattr(launcher, "when_training"):
        try:
            launcher.when_training(nodes)
        except (OSError, ValueError) as e:  # an optimisation: never the attempt's end
            log.warning("could not start the standby: %s", e)
    if start_method == "fork" and prewarm:
        warm.prepare(attempt + 1, nodes)


def run_attempt(st: ClusterState, nodes: list[Node], nproc: int, worker_argv: list[str],
                env: dict[str, str], attempt: int, stop: threading.Event,
                preempt: threading.Event, log_dir=None, launcher=None,
                warm: WarmLaunchers | None = None, start_method: str = "fork",
                started: Callable[[], bool] | None = None,
                spares: list[Node] = (), prewarm: bool = True) -> AttemptEnd:  # fmt: skip
    """Runs one attempt on `nodes` until it ends, fails or is stopped.
    `stop`: tear down now (the monitor saw a fault); `preempt`: forward SIGTERM to every
    node's launcher (which passes it to the ranks) and give the last-gasp checkpoint time.
    `launcher` (resilience.control = "store"): wraps each node's launcher in its node agent
    (.command, .env) and tears a node down its own way (.kill). `warm`: where this attempt's
    launchers may already be waiting, and the next attempt's are started once `started()`
    says the ranks are training (fork only: a spawning launcher gains nothing from its imports),
    on `spares` (hot spare nodes) too (not with `prewarm` off: resilience.warm_launchers); so is
    `launcher.when_training` (if it has one)."""
    own_warm = warm is None
    warm = warm or WarmLaunchers(log_dir, launcher)
    warm.retire(attempt, nodes)
    rdzv_id = f"wanka-{uuid.uuid4().hex[:8]}"
    port = RDZV_PORT + attempt % 50  # a torn-down store may still hold the last port briefly
    procs: dict[str, subprocess.Popen] = {}
    first_failed, own_code, t_failed = None, None, None
    t_start, prepared = time.monotonic(), False
    try:
        for i, node in enumerate(nodes):
            node_env = nd.node_env(node, dict(env))
            if launcher is not None:  # e.g. the node's own heartbeat folder
                node_env = launcher.env(node, node_env, attempt)
            orders = {"torchrun": torchrun_options(st, i, nproc, rdzv_id, port, nodes, static=True),
                      "argv": worker_argv, "env": node_env, "start_method": start_method}  # fmt: skip
            if launcher is not None:  # e.g. the control store's address, for the node's agent
                orders = launcher.orders(orders)
            try:
                p = warm.take(attempt, node)
                if not _give_orders(p, orders):
                    _dismiss(p)
                    p = start_launcher(node, attempt, log_dir, launcher)
                    _give_orders(p, orders)
            except (OSError, ValueError) as e:  # the node cannot start anything: it failed
                log.error("node %s: cannot start its launcher: %s", node.name, e)
                return AttemptEnd([p.poll() or 0 for p in procs.values()] + [1], node.name, 1,
                                  time.time())  # fmt: skip
            procs[node.name] = p
        # Every launcher is polled each time (any() would stop at the first live one, and a
        # dead node's launcher would go unseen until the others ended).
        while not all([p.poll() is not None for p in procs.values()]):
            if preempt.is_set():
                for p in procs.values():
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
                    time.sleep(0.05)
                break
            first_failed, own_code = _first_failure(procs)
            if first_failed is not None or stop.is_set():
                break
            if not prepared and (
                (started is not None and started()) or time.monotonic() - t_start > PREWARM_AFTER_S
            ):
                prepared = True
                _prepare_next(warm, launcher, attempt, [*nodes, *spares], start_method, prewarm)
            time.sleep(0.05)
        if first_failed is None and not stop.is_set() and not preempt.is_set():
            first_failed, own_code = _first_failure(procs)  # all ended before a look
        t_failed = time.time() if first_failed is not None else None
    finally:
        for name, p in procs.items():  # the whole process group: the launcher and its ranks
            if launcher is not None:
                launcher.kill(name, p)
            else:  # even if the launcher is gone: its forked ranks share its group
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs.values():
            p.wait()
        if own_warm:
            warm.close()
    if first_failed is None:
        first_failed = next((n for n, p in procs.items() if p.returncode), None)
    return AttemptEnd([p.returncode for p in procs.values()], first_failed, own_code, t_failed)
