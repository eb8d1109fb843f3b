"""The cluster's state file: what `up` made, written *before* each thing is made, so that `down`
(or the next `up` after a crash) removes exactly that and nothing else."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_STATE_DIR = "/run/wanka-cluster"
STATE_FILE = "cluster.json"
# Inside a node: its own run-state folder (a node-private folder bound here, like /dev/shm).
NODE_LOCAL = "/run/wanka-node"


def state_dir(given: str | None = None) -> Path:
    return Path(given or os.environ.get("WANKA_CLUSTER_STATE") or DEFAULT_STATE_DIR)


@dataclass
class Node:
    name: str  # user-facing: n0, n1, ...
    netns: str  # network namespace
    veth_host: str  # bridge side of the node's link (in the root namespace)
    veth_node: str  # node side of the link (inside the namespace): GLOO_SOCKET_IFNAME
    addr: str  # the node's address on the private network
    # Host folder (on tmpfs) with the node's private memory: shm/ (its /dev/shm) and local/
    # (NODE_LOCAL);
    # "" for a cluster made before nodes had them (they then share the host's).
    root: str = ""


@dataclass
class ClusterState:
    name: str
    subnet: str
    bridge: str
    link_gbit: float
    intra_gbit: float | None
    nodes: list[Node] = field(default_factory=list)
    # ("netns" | "link", name) in creation order; `down` removes these in reverse.
    made: list[list[str]] = field(default_factory=list)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if name in (n.name, n.netns):
                return n
        known = ", ".join(n.name for n in self.nodes)
        raise ValueError(f"unknown node {name!r}: this cluster has {known}")

    @property
    def master(self) -> Node:
        return self.nodes[0]


def load(sdir: str | Path | None = None) -> ClusterState | None:
    path = state_dir(str(sdir) if sdir else None) / STATE_FILE
    if not path.exists():
        return None
    try:
        return _parse(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError, AttributeError, OSError, UnicodeError) as e:
        why = "empty" if _empty(path) else (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"the cluster state {path} is damaged ({why}): remove it (rm {path}); "
            "`wanka cluster up` with the same --name then clears what it left "
            "behind"
        ) from None


def _empty(path: Path) -> bool:
    try:
        return not path.read_bytes().strip()
    except OSError:
        return False


def _parse(raw: object) -> ClusterState:
    """A ClusterState from the file's JSON, every field there and of its type (ValueError)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a JSON object expected, not {type(raw).__name__}")
    want = {f.name for f in fields(ClusterState)}
    if set(raw) != want:
        odd = sorted(set(raw) ^ want)
        raise ValueError(f"fields {', '.join(odd)} missing or unknown")
    node_fields = {f.name for f in fields(Node)}
    nodes = []
    for n in raw["nodes"] if isinstance(raw["nodes"], list) else [None]:
        if not isinstance(n, dict) or not set(n) <= node_fields or not {
            f.name for f in fields(Node) if f.name != "root"} <= set(n):  # fmt: skip
            raise ValueError(f"a node is not one: {json.dumps(n)[:60]}")
        if not all(isinstance(v, str) for v in n.values()):
            raise ValueError(f"a node's fields are not names: {json.dumps(n)[:60]}")
        nodes.append(Node(**n))
    made = raw["made"]
    if not isinstance(made, list) or not all(
        isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m) for m in made
    ):
        raise ValueError("'made' is not a list of [kind, name]")
    if not all(isinstance(raw[k], str) for k in ("name", "subnet", "bridge")):
        raise ValueError("name, subnet and bridge must be strings")
    if not isinstance(raw["link_gbit"], int | float) or not (
        raw["intra_gbit"] is None or isinstance(raw["intra_gbit"], int | float)
    ):
        raise ValueError("link_gbit and intra_gbit must be numbers")
    return ClusterState(**{**raw, "nodes": nodes})


def require(sdir: str | Path | None = None) -> ClusterState:
    st = load(sdir)
    if st is None:
        where = state_dir(str(sdir) if sdir else None)
        raise ValueError(f"no cluster is up (no state in {where}); run `wanka cluster up` first")
    return st


def save(st: ClusterState, sdir: str | Path | None = None) -> None:
    d = state_dir(str(sdir) if sdir else None)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(st), indent=1))
    tmp.replace(d / STATE_FILE)  # atomic: a crash never leaves half a state file


def remove(sdir: str | Path | None = None) -> None:
    (state_dir(str(sdir) if sdir else None) / STATE_FILE).unlink(missing_ok=True)
