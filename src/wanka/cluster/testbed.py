"""Bring the cluster up and down. Each node is a network namespace wired to a private bridge by
a veth pair; the pair is shaped with tbf in both directions (node side: egress from the node,
bridge side: egress towards it), so node-to-node traffic crosses two shaped hops of the same
rate, like one full-duplex link. Loopback inside a node carries intra-node traffic, unshaped
unless `intra_gbit` is given. The bridge has no address and no uplink: nothing can leave."""

from __future__ import annotations

import ipaddress
import math
import re
import shutil
import sys
import time
from pathlib import Path

from wanka.cluster import netns as nx
from wanka.cluster.nodes import NODES_SHM, make_private
from wanka.cluster.state import STATE_FILE, ClusterState, Node, load, remove, save, state_dir

DEFAULT_SUBNET = "10.231.0.0/24"
NAME_RE = re.compile(r"[a-z][a-z0-9]{0,5}")  # keeps "<name>-n63h" under the 15-char ifname limit
GBIT_RANGE = (0.001, 1000.0)  # 1 Mbit/s .. 1 Tbit/s: what tc's tbf shapes faithfully
OWNER = ".state-dir"  # in the cluster's memory folder: the state dir of the cluster of that name


def names(name: str, i: int) -> Node:
    """Deterministic names: a crashed `up` that lost its state file is still recognisable."""
    return Node(name=f"n{i}", netns=f"wanka-{name}-n{i}", veth_host=f"{name}-n{i}h",
                veth_node=f"{name}-n{i}", addr="")  # fmt: skip


def _check_subnet(subnet: str, nodes: int) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise ValueError(f"bad --subnet {subnet!r}: {e}") from None
    private = [ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]
    if not any(net.subnet_of(p) for p in private):
        raise ValueError(
            f"--subnet {subnet} is not private (use part of 10/8, 172.16/12, 192.168/16)"
        )
    if net.num_addresses - 2 < nodes:
        raise ValueError(f"--subnet {subnet} is too small for {nodes} nodes")
    # Never shadow a network the host already uses: our addresses must exist only in our nodes.
    for dst in nx.routes() + nx.addrs():
        if dst != "default" and net.overlaps(ipaddress.IPv4Network(dst, strict=False)):
            raise ValueError(f"--subnet {subnet} overlaps the host's {dst}; pick another --subnet")
    return net


def _leftovers(name: str) -> tuple[list[str], list[str]]:
    """Namespaces and root links named like ours (from a run that crashed without state)."""
    ns = sorted(n for n in nx.netns_list() if re.fullmatch(rf"wanka-{name}-n\d+", n))
    pat = rf"{name}-(br|n\d+h)"
    ln = sorted(x["ifname"] for x in nx.links() if re.fullmatch(pat, x["ifname"]))
    return ns, ln


def _remove(kind: str, obj: str) -> bool:
    """Remove a namespace or a root link; False when it was already gone."""
    if kind == "netns":
        if obj in nx.netns_list():
            nx.kill_netns_pids(obj)
            nx.sh("ip", "netns", "del", obj)
            return True
    elif nx.link_exists(obj):
        nx.sh("ip", "link", "del", "dev", obj, check=False)  # may vanish with its peer meanwhile
        return True
    return False


def _ours(sdir: str | Path | None) -> str:
    return str(state_dir(str(sdir) if sdir else None).resolve())


def _marker(name: str) -> str | None:
    """The state dir the last `up` of a cluster named `name` recorded it in, if any."""
    try:
        return (Path(NODES_SHM) / name / OWNER).read_text().strip()
    except OSError:
        return None


def owner_of(name: str) -> str | None:
    """The state dir of the cluster named `name` that `up` made last, while it is up (its
    state file there names it); None when none is."""
    owner = _marker(name)
    if owner is None:
        return None
    try:
        st = load(owner)
    except ValueError:  # damaged, but there: somebody's cluster may still be up
        return owner
    return owner if st is not None and st.name == name else None


def _check_name_free(name: str, sdir: str | Path | None) -> None:
    """Refuse a name a live cluster of another state dir uses: its namespaces and links have
    the same names, and tearing them down as a crash's leftovers would take that cluster."""
    owner = owner_of(name)
    if owner is not None and owner != _ours(sdir):
        raise ValueError(f"--name {name} is used by the cluster recorded in {owner} (its "
                         f"{Path(owner) / STATE_FILE}): pick another --name, or take that one "
                         f"down first (wanka cluster down --state-dir {owner})")  # fmt: skip
    if owner is None and _marker(name) != _ours(sdir):  # not our own crash's leftovers:
        # removable, unless still in use
        busy = [ns for ns in _leftovers(name)[0] if nx.netns_pids(ns)]
        if busy:
            raise ValueError(f"--name {name}: the namespaces {', '.join(busy)} still run "
                             "processes of a cluster not recorded here: pick another --name, "
                             "or end those processes first (ip netns pids NS)")  # fmt: skip


def _make(st: ClusterState, kind: str, obj: str, sdir: str | Path | None, *cmd: str) -> None:
    st.made.append([kind, obj])
    save(st, sdir)  # record first: a crash right after creating still gets cleaned up
    nx.sh(*cmd)


def create_node(st: ClusterState, node: Node, prefixlen: int, sdir: str | Path | None) -> None:
    ns, vh, vn = node.netns, node.veth_host, node.veth_node
    node.root = node.root or str(Path(NODES_SHM) / st.name / node.name)
    make_private(node)
    _make(st, "netns", ns, sdir, "ip", "netns", "add", ns)
    _make(st, "link", vh, sdir, "ip", "link", "add", vh, "type", "veth", "peer", "name", vn,
          "netns", ns)  # fmt: skip
    # addrgenmode none: no IPv6 link-local chatter; the only addresses are the ones we give.
    nx.sh("ip", "link", "set", vh, "addrgenmode", "none")
    nx.sh("ip", "link", "set", vh, "master", st.bridge, "up")
    nx.sh("ip", "-n", ns, "link", "set", "lo", "up")
    nx.sh("ip", "-n", ns, "link", "set", vn, "addrgenmode", "none")
    nx.sh("ip", "-n", ns, "addr", "add", f"{node.addr}/{prefixlen}", "dev", vn)
    nx.sh("ip", "-n", ns, "link", "set", vn, "up")
    nx.shape(vn, st.link_gbit, ns)  # node -> bridge
    nx.shape(vh, st.link_gbit)  # bridge -> node
    if st.intra_gbit:
        nx.shape("lo", st.intra_gbit, ns)


def _healthy(st: ClusterState) -> bool:
    have = nx.netns_list()
    return nx.link_exists(st.bridge) and all(
        n.netns in have and nx.link_exists(n.veth_host) for n in st.nodes
    )


def up(nodes: int, link_gbit: float = 1.0, intra_gbit: float | None = None, name: str = "wk",
       subnet: str = DEFAULT_SUBNET, sdir: str | Path | None = None) -> ClusterState:  # fmt: skip
    """Create the cluster. Idempotent: the same request on a healthy cluster changes nothing;
    anything else (other parameters, a half-made or crashed cluster) is torn down first."""
    if not 1 <= nodes <= 64:
        raise ValueError(f"--nodes {nodes}: use 1..64")
    lo, hi = GBIT_RANGE
    for flag, v in (("--link-gbit", link_gbit), ("--intra-gbit", intra_gbit)):
        if v is not None and not (math.isfinite(v) and lo <= v <= hi):
            raise ValueError(f"{flag} {v:g}: a rate of {lo:g} to {hi:g} Gbit/s")
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"--name {name!r}: 1-6 lowercase letters/digits, starting with a letter")
    net = _check_subnet(subnet, nodes)  # before touching anything: bad input changes nothing
    old = load(sdir)
    if not (old and old.name == name):
        _check_name_free(name, sdir)
    want = (name, str(net), nodes, link_gbit, intra_gbit)
    if old and (old.name, old.subnet, len(old.nodes), old.link_gbit, old.intra_gbit) == want:
        if _healthy(old):
            return old
    if old:
        down(sdir)
    stale_ns, stale_links = _leftovers(name)
    for ln in stale_links:
        _remove("link", ln)
    for ns in stale_ns:
        _remove("netns", ns)
    nx.wait_gone(stale_links)
    shutil.rmtree(Path(NODES_SHM) / name, ignore_errors=True)  # a new cluster's memory is empty
    (Path(NODES_SHM) / name).mkdir(parents=True, exist_ok=True)
    (Path(NODES_SHM) / name / OWNER).write_text(_ours(sdir) + "\n")
    hosts = net.hosts()
    st = ClusterState(name=name, subnet=str(net), bridge=f"{name}-br", link_gbit=link_gbit,
                      intra_gbit=intra_gbit)  # fmt: skip
    try:
        _make(st, "link", st.bridge, sdir, "ip", "link", "add", st.bridge, "type", "bridge")
        nx.sh("ip", "link", "set", st.bridge, "addrgenmode", "none")
        nx.sh("ip", "link", "set", st.bridge, "up")
        for i in range(nodes):
            node = names(name, i)
            node.addr = str(next(hosts))
            st.nodes.append(node)
            create_node(st, node, net.prefixlen, sdir)
        save(st, sdir)
    except BaseException:
        down(sdir)  # leave nothing half-made behind
        raise
    return st


def down(sdir: str | Path | None = None) -> list[str]:
    """Remove what the state file says we made (and only that); returns what was removed."""
    st = load(sdir)
    if st is None:
        return []
    owner = owner_of(st.name)
    if owner is not None and owner != _ours(sdir):  # its names were taken over: not ours now
        print(f"the cluster {st.name} recorded in {_ours(sdir)} is gone: its names now belong "
              f"to the cluster recorded in {owner}, which stays up; only {STATE_FILE} "
              "removed here", file=sys.stderr)  # fmt: skip
        remove(sdir)
        return []
    removed = []
    # Processes first (a namespace held by a process outlives `ip netns del`), then the links,
    # then the namespaces.
    for kind in ("netns-pids", "link", "netns"):
        for k, obj in reversed(st.made):
            if kind == "netns-pids" and k == "netns" and obj in nx.netns_list():
                nx.kill_netns_pids(obj)
            elif k == kind and _remove(k, obj):
                removed.append(obj)
    nx.wait_gone([obj for k, obj in st.made if k == "link"])
    for n in st.nodes:  # the nodes' memory
        if n.root:
            shutil.rmtree(n.root, ignore_errors=True)
    (Path(NODES_SHM) / st.name / OWNER).unlink(missing_ok=True)
    try:
        (Path(NODES_SHM) / st.name).rmdir()
    except OSError:
        pass  # not ours, or not empty
    remove(sdir)
    return removed


def status(sdir: str | Path | None = None) -> dict:
    st = load(sdir)
    if st is None:
        return {"up": False}
    have = nx.netns_list()
    nodes = []
    for n in st.nodes:
        alive = n.netns in have
        link = next((x for x in nx.links() if x["ifname"] == n.veth_host), None)
        nodes.append({
            "node": n.name, "netns": n.netns if alive else None, "addr": n.addr,
            "link": ("up" if "UP" in link["flags"] else "cut") if link else "missing",
            "procs": len(nx.netns_pids(n.netns)) if alive else 0,
            "shaping": nx.qdisc(n.veth_host),
        })  # fmt: skip
    return {"up": True, "healthy": _healthy(st), "name": st.name, "subnet": st.subnet,
            "bridge": st.bridge, "link_gbit": st.link_gbit, "intra_gbit": st.intra_gbit,
            "nodes": nodes}  # fmt: skip


def wait_link(st: ClusterState, timeout: float = 5.0) -> None:
    """Until every node's veth reports carrier (a fresh bridge port takes a moment)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all("LOWER_UP" in x["flags"] for x in nx.links() if x["ifname"].startswith(st.name)):
            return
        time.sleep(0.05)
