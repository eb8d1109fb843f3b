"""Per-node actions: run a command inside a node, kill a node (every process in its namespace
at once, like losing power: its memory goes too), cut and restore its link, and bring a node
back.

A node shares the host's filesystem (run directories and DCP checkpoints are on shared
storage, as on a real cluster) but not its memory: each command runs in a mount namespace
where /dev/shm and NODE_LOCAL are the node's own folders and the other nodes' are hidden, so
nothing passes between nodes through memory-backed files; only the network carries it."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

from wanka.cluster import netns as nx
from wanka.cluster.state import NODE_LOCAL, ClusterState, Node, require, save

# Every node's memory lives on the host's /dev/shm (tmpfs) under NODES_SHM/<cluster>/<node>.
# Run by `ip netns exec` (which already gives the command a mount namespace of its own, a slave
# of the host's: nothing mounted here shows outside): the node's run-state folder, then its
# /dev/shm, which also covers the host's, so no node sees another's; then the command itself.
NODES_SHM = "/dev/shm/wanka-nodes"
_PRIVATE = 'mount --bind "$1/local" "$2" && mount --bind "$1/shm" /dev/shm && shift 2 && exec "$@"'
# Before that, for a job whose run directory is the node's own but for its checkpoints (shared
# storage, as DCP expects): the shared checkpoints folder into the node's copy, which then
# covers the run directory (--rbind: with that mount inside it).
_OWN_RUN_DIR = (
    'mount --bind "$1/checkpoints" "$2/checkpoints" && mount --rbind "$2" "$1" '
    '&& shift 2 && exec "$@"'
)
# Set (to 1) in a supervisor's environment: its cluster job's launchers run that way.
OWN_RUN_DIR_ENV = "WANKA_NODE_OWN_RUN_DIR"


def node_path(node: Node, path: str | Path) -> Path | None:
    """Where the host sees `path` of the node's memory (/dev/shm/... or NODE_LOCAL/...);
    None if the node's memory is the host's (no root) or `path` is not in it."""
    if not node.root:
        return None
    for inside, sub in (("/dev/shm", "shm"), (NODE_LOCAL, "local")):
        try:
            return Path(node.root) / sub / Path(path).relative_to(inside)
        except ValueError:
            continue
    return None


def sweep_node_snapshots(st: ClusterState, snapshot_dir: str, max_age_h: float,
                         current: str | None) -> list[str]:  # fmt: skip
    """The start-of-job sweep (train/run_lock.py) in every node's own memory, which the host's
    sweep does not see; returns what it says."""
    from wanka.train.run_lock import sweep_snapshots, swept_line

    said = []
    for n in st.nodes:
        where = node_path(n, snapshot_dir)
        if where is not None:
            said += [swept_line(f, max_age_h, n.name)
                     for f in sweep_snapshots(where, max_age_h, current)]  # fmt: skip
    return said


def node_env(node: Node, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process in `node`: it knows its node, and gloo binds the node's
    veth (by default gloo uses the hostname's address, 127.0.0.1 here, which peers can't reach)."""
    env = dict(os.environ if base is None else base)
    env.update(WANKA_NODE=node.name, WANKA_NODE_ADDR=node.addr, GLOO_SOCKET_IFNAME=node.veth_node,
               TP_SOCKET_IFNAME=node.veth_node)  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    if node.root:  # NCCL tells hosts apart by this (else by hostname, which all nodes share)
        env["NCCL_HOSTID"] = node.name
    return env


def exec_argv(node: Node, cmd: list[str], own_run_dir: str | Path | None = None) -> list[str]:
    """`own_run_dir`: that run directory is the node's own (NODE_ROOT/run/...) inside, except
    its checkpoints folder: nothing else written there is seen by another node or the host."""
    if not node.root:
        return ["ip", "netns", "exec", node.netns, *cmd]
    make_private(node)  # cheap; a node whose memory folders were removed still starts
    cmd = ["sh", "-c", _PRIVATE, "wanka-node", node.root, NODE_LOCAL, *cmd]
    if own_run_dir is not None:  # first: the node's copy lives on the host's /dev/shm
        run = Path(own_run_dir).resolve()
        mine = node_run_dir(node, run)
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        (mine / "checkpoints").mkdir(parents=True, exist_ok=True)
        cmd = ["sh", "-c", _OWN_RUN_DIR, "wanka-run-dir", str(run), str(mine), *cmd]
    return ["ip", "netns", "exec", node.netns, *cmd]


def node_run_dir(node: Node, run_dir: str | Path) -> Path:
    """Where the host sees a node's own copy of `run_dir` (exec_argv's own_run_dir)."""
    return Path(node.root) / "run" / str(Path(run_dir).resolve()).lstrip("/")


def make_private(node: Node) -> None:
    """The node's memory folders on the host, and the mount point of NODE_LOCAL."""
    if node.root:
        for sub in ("shm", "local"):
            d = Path(node.root) / sub
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o1777)  # as /dev/shm: anyone may write, only owners remove (umask aside)
        Path(NODE_LOCAL).mkdir(parents=True, exist_ok=True)


def wipe(node: Node) -> None:
    """What a power loss does to the node's memory: /dev/shm and NODE_LOCAL are empty."""
    if node.root:
        for sub in ("shm", "local"):
            shutil.rmtree(Path(node.root) / sub, ignore_errors=True)
        make_private(node)


def popen(node: Node, cmd: list[str], **kw) -> subprocess.Popen:
    """Start `cmd` inside the node (same filesystem, its own network)."""
    env = node_env(node, kw.pop("env", None))
    own_run_dir = kw.pop("own_run_dir", None)
    if node.netns not in nx.netns_list():
        raise ValueError(f"node {node.name} is down (no namespace); `wanka cluster start-node` it")
    return subprocess.Popen(exec_argv(node, cmd, own_run_dir), env=env, **kw)


def run(st: ClusterState, node: str, cmd: list[str], **kw) -> int:
    if not cmd:
        raise ValueError("nothing to run: wanka cluster run NODE -- CMD ...")
    return popen(st.node(node), cmd, **kw).wait()


def kill_node(st: ClusterState, node: str) -> int:
    """SIGKILL all of the node's processes at once and empty its memory; the namespace stays
    for a relaunch."""
    n = st.node(node)
    killed = nx.kill_netns_pids(n.netns) if n.netns in nx.netns_list() else 0
    wipe(n)
    return killed


def set_link(st: ClusterState, node: str, up: bool) -> None:
    """Cut (or restore) the cable: the bridge side of the node's veth goes down, so nothing
    inside the node can undo it; the node sees NO-CARRIER and its peers time out."""
    n = st.node(node)
    if not nx.link_exists(n.veth_host):
        raise ValueError(f"node {n.name} has no link; `wanka cluster start-node {n.name}` first")
    nx.sh("ip", "link", "set", n.veth_host, "up" if up else "down")


def start_node(st: ClusterState, node: str, sdir: str | Path | None = None) -> None:
    """Bring a node back: re-create its namespace and link if they are gone, restore the link
    if it was cut. Processes are the caller's to relaunch (`run` / the launcher)."""
    from wanka.cluster.testbed import create_node

    n = st.node(node)
    if n.netns not in nx.netns_list() or not nx.link_exists(n.veth_host):
        if nx.link_exists(n.veth_host):
            nx.sh("ip", "link", "del", "dev", n.veth_host)
        if n.netns in nx.netns_list():
            nx.sh("ip", "netns", "del", n.netns)
        nx.wait_gone([n.veth_host])
        st.made = [m for m in st.made if m[1] not in (n.netns, n.veth_host)]
        create_node(st, n, ipaddress.IPv4Network(st.subnet).prefixlen, sdir)
        save(st, sdir)
    make_private(n)  # its memory folders may have been removed meanwhile (rm -rf /dev/shm/*)
    set_link(st, node, True)


def remove_node(st: ClusterState, node: str) -> None:
    """The node is gone for good (hardware loss): kill its processes, delete its namespace."""
    n = st.node(node)
    if n.netns in nx.netns_list():
        nx.kill_netns_pids(n.netns)
        nx.sh("ip", "netns", "del", n.netns)
    nx.wait_gone([n.veth_host])
    if n.root:
        shutil.rmtree(n.root, ignore_errors=True)


class NodeActions:
    """What a fault drill does to the nodes of a live cluster (re-reading its state each time)."""

    def __init__(self, sdir: str | Path | None = None) -> None:
        self.sdir = sdir

    def kill_node(self, node: str) -> int:
        return kill_node(require(self.sdir), node)

    def set_link(self, node: str, up: bool) -> None:
        set_link(require(self.sdir), node, up)
