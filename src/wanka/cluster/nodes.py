"""Per-node actions: run a command inside a node, kill a node (every process in its namespace
at once, like losing power), cut and restore its link, and bring a node back."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path

from wanka.cluster import netns as nx
from wanka.cluster.state import ClusterState, Node, require, save


def node_env(node: Node, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process in `node`: it knows its node, and gloo binds the node's
    veth (by default gloo uses the hostname's address, 127.0.0.1 here, which peers can't reach)."""
    env = dict(os.environ if base is None else base)
    env.update(WANKA_NODE=node.name, WANKA_NODE_ADDR=node.addr, GLOO_SOCKET_IFNAME=node.veth_node,
               TP_SOCKET_IFNAME=node.veth_node)  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def exec_argv(node: Node, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", node.netns, *cmd]


def popen(node: Node, cmd: list[str], **kw) -> subprocess.Popen:
    """Start `cmd` inside the node (same filesystem, its own network)."""
    env = node_env(node, kw.pop("env", None))
    if node.netns not in nx.netns_list():
        raise ValueError(f"node {node.name} is down (no namespace); `wanka cluster start-node` it")
    return subprocess.Popen(exec_argv(node, cmd), env=env, **kw)


def run(st: ClusterState, node: str, cmd: list[str], **kw) -> int:
    if not cmd:
        raise ValueError("nothing to run: wanka cluster run NODE -- CMD ...")
    return popen(st.node(node), cmd, **kw).wait()


def kill_node(st: ClusterState, node: str) -> int:
    """SIGKILL all of the node's processes at once; the namespace stays for a relaunch."""
    n = st.node(node)
    return nx.kill_netns_pids(n.netns) if n.netns in nx.netns_list() else 0


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
    set_link(st, node, True)


def remove_node(st: ClusterState, node: str) -> None:
    """The node is gone for good (hardware loss): kill its processes, delete its namespace."""
    n = st.node(node)
    if n.netns in nx.netns_list():
        nx.kill_netns_pids(n.netns)
        nx.sh("ip", "netns", "del", n.netns)
    nx.wait_gone([n.veth_host])


class NodeActions:
    """What a fault drill does to the nodes of a live cluster (re-reading its state each time)."""

    def __init__(self, sdir: str | Path | None = None) -> None:
        self.sdir = sdir

    def kill_node(self, node: str) -> int:
        return kill_node(require(self.sdir), node)

    def set_link(self, node: str, up: bool) -> None:
        set_link(require(self.sdir), node, up)
