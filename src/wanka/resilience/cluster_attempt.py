"""One attempt of a supervised job across the cluster-in-a-box: torchrun on every healthy node.

The supervisor (resilience/supervisor.py) decides which nodes take part (evicted ones do not)
and watches every rank's heartbeat; this module starts torchrun inside each chosen node's
namespace, all meeting at a fresh c10d rendezvous on the first chosen node, waits, and tears
the attempt down as soon as one node fails so the others do not wait on a dead peer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import uuid

from wanka.cluster import nodes as nd
from wanka.cluster.launch import RDZV_PORT, torchrun_argv
from wanka.cluster.state import ClusterState, Node


def run_attempt(st: ClusterState, nodes: list[Node], nproc: int, worker_argv: list[str],
                env: dict[str, str], attempt: int, stop: threading.Event,
                preempt: threading.Event, log_dir=None,
                launcher=None) -> tuple[list[int], str | None]:  # fmt: skip
    """Returns (exit codes of the node launchers, name of the first node that failed).
    `stop`: tear down now (the monitor saw a fault); `preempt`: forward SIGTERM to every
    node's torchrun (which forwards it to the ranks) and give the last-gasp checkpoint time.
    `launcher` (resilience.control = "store"): wraps each node's torchrun in its node agent
    (.command, .env) and tears a node down its own way (.kill)."""
    rdzv_id = f"wanka-{uuid.uuid4().hex[:8]}"
    port = RDZV_PORT + attempt % 50  # a torn-down store may still hold the last port briefly
    procs: dict[str, subprocess.Popen] = {}
    for i, node in enumerate(nodes):
        out = subprocess.DEVNULL
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            out = open(log_dir / f"{node.name}-attempt{attempt}.log", "w")  # noqa: SIM115
        argv = torchrun_argv(st, i, nproc, ["-m", "wanka.cli", *worker_argv], rdzv_id, port, nodes)
        node_env = {**os.environ, **env}
        if launcher is not None:
            argv, node_env = launcher.command(node, argv), launcher.env(node, node_env)
        procs[node.name] = nd.popen(node, argv, env=node_env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    first_failed = None
    try:
        while any(p.poll() is None for p in procs.values()):
            if preempt.is_set():
                for p in procs.values():
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
                    time.sleep(0.05)
                break
            failed = [n for n, p in procs.items() if p.returncode not in (None, 0)]
            if failed or stop.is_set():
                first_failed = failed[0] if failed else None
                break
            time.sleep(0.05)
    finally:
        for name, p in procs.items():  # the whole process group: torchrun and its ranks
            if launcher is not None:
                launcher.kill(name, p)
            elif p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs.values():
            p.wait()
    if first_failed is None:
        first_failed = next((n for n, p in procs.items() if p.returncode), None)
    return [p.returncode for p in procs.values()], first_failed
