"""One job across the nodes: torchrun inside every node's namespace, all meeting at a c10d
rendezvous hosted by node 0's agent on node 0's address, so gloo traffic between ranks on
different nodes crosses the shaped links and traffic between ranks on one node stays on its
loopback."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from wanka.cluster import nodes as nd
from wanka.cluster.state import ClusterState, Node, require

RDZV_PORT = 29400


STATIC_JOIN_TIMEOUT_S = 120  # seconds; a launcher joins once its imports are done


def torchrun_options(st: ClusterState, i: int, nproc_per_node: int, rdzv_id: str,
                     port: int = RDZV_PORT, nodes: list | None = None,
                     static: bool = False) -> list[str]:  # fmt: skip
    """torchrun's options for node i of `nodes` (default: all of the cluster's). `static`:
    torchrun's static rendezvous, node i is node rank i (the supervisor, which already chose
    every node of an attempt and their order, uses it: c10d's join polls its state once a
    second, a second on every restart); else the c10d rendezvous."""
    nodes = nodes or st.nodes
    if static:
        return [
            f"--nnodes={len(nodes)}", f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=static", f"--rdzv-endpoint={nodes[0].addr}:{port}",
            f"--rdzv-id={rdzv_id}", f"--node-rank={i}", f"--local-addr={nodes[i].addr}",
            # A node that never joins fails the attempt after this (torchrun's default, 900 s,
            # would hold every other node that long; c10d's join gave up after 600 s).
            f"--rdzv-conf=timeout={STATIC_JOIN_TIMEOUT_S}",
        ]  # fmt: skip
    return [
        f"--nnodes={len(nodes)}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={nodes[0].addr}:{port}", f"--rdzv-id={rdzv_id}",
        # Inside a namespace the hostname resolves to 127.0.0.1: say explicitly who hosts the
        # rendezvous store and which address this node's agent advertises.
        f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={nodes[i].addr}",
    ]  # fmt: skip


def torchrun_argv(st: ClusterState, i: int, nproc_per_node: int, target: list[str],
                  rdzv_id: str, port: int = RDZV_PORT, nodes: list | None = None,
                  extra: list[str] | None = None) -> list[str]:  # fmt: skip
    """torchrun for node i of `nodes` (default: all of the cluster's). `target` is what torchrun
    runs: ["-m", "wanka.cli", ...] or a script path and its arguments; `extra`: more torchrun
    options (e.g. --max-restarts=3)."""
    return [sys.executable, "-m", "torch.distributed.run",
            *torchrun_options(st, i, nproc_per_node, rdzv_id, port, nodes), *(extra or []),
            *target]  # fmt: skip


def run_on_cluster(nproc_per_node: int, target: list[str], state_dir: str | None = None,
                   timeout: float | None = None, spare_nodes: int = 0, **popen_kw) -> int:  # fmt: skip
    """Start torchrun on every node (but the last `spare_nodes`), wait for all; the first
    non-zero exit code, else 0. When one node fails the others are stopped rather than left
    waiting for it."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc must be 1 or more (got {nproc_per_node}): ranks per node")
    st = require(state_dir)
    nodes = job_nodes(st, spare_nodes)
    rdzv_id = f"wanka-{uuid.uuid4().hex[:8]}"
    procs = [nd.popen(n, torchrun_argv(st, i, nproc_per_node, target, rdzv_id, nodes=nodes),
                      **popen_kw) for i, n in enumerate(nodes)]  # fmt: skip
    deadline = None if timeout is None else time.monotonic() + timeout
    rc = 0
    try:
        while not all([p.poll() is not None for p in procs]):  # poll each: any() stops early
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or (deadline is not None and time.monotonic() > deadline):
                rc = failed[0] if failed else 124
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # torchrun forwards this to its ranks
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return rc or next((p.returncode for p in procs if p.returncode), 0)


def launch_on_cluster(nproc_per_node: int, worker_args: list[str],
                      state_dir: str | None = None, spare_nodes: int = 0) -> int:  # fmt: skip
    """`wanka <worker_args...>` as one job over every node of the cluster (but the last
    `spare_nodes`), `nproc_per_node` ranks each. Every rank has WANKA_NODE (its node's name)
    in its environment."""
    return run_on_cluster(nproc_per_node, ["-m", "wanka.cli", *worker_args], state_dir,
                          spare_nodes=spare_nodes)  # fmt: skip


def job_nodes(st: ClusterState, spare_nodes: int = 0) -> list[Node]:
    """The nodes a job without a supervisor trains on: all but the last `spare_nodes` (the
    world a supervised job with that many hot spares starts with)."""
    if not 0 <= spare_nodes < len(st.nodes):
        raise ValueError(f"resilience.spare_nodes={spare_nodes} leaves no node to train on: the "
                         f"cluster has {len(st.nodes)}; set it below that")  # fmt: skip
    return st.nodes[: len(st.nodes) - spare_nodes]
