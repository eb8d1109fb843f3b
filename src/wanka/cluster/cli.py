"""argparse wiring: `wanka cluster ...` and `wanka bench net`. Every handler takes the parsed
Namespace and returns an exit code; bad input raises ValueError (one line, exit 2)."""

from __future__ import annotations

import argparse
import json

from wanka.cluster import launch, nodes, testbed
from wanka.cluster.state import require


def _up(a: argparse.Namespace) -> int:
    st = testbed.up(a.nodes, a.link_gbit, a.intra_gbit, a.name, a.subnet, a.state_dir)
    intra = f"{st.intra_gbit:g} Gbit/s" if st.intra_gbit else "unshaped"
    print(f"cluster {st.name}: {len(st.nodes)} nodes on {st.subnet}, links {st.link_gbit:g} "
          f"Gbit/s, intra-node {intra}")  # fmt: skip
    for n in st.nodes:
        print(f"  {n.name}  {n.addr:15s} netns {n.netns}  if {n.veth_node}")
    return 0


def _down(a: argparse.Namespace) -> int:
    from wanka.cluster.state import load

    st = load(a.state_dir)
    removed = testbed.down(a.state_dir)
    if st is None:
        print("no cluster was up")
    else:
        print(f"removed {' '.join(removed)}" if removed else
              f"cluster {st.name}: nothing left to remove (already gone)")  # fmt: skip
    return 0


def _status(a: argparse.Namespace) -> int:
    s = testbed.status(a.state_dir)
    if a.json or not s["up"]:
        print(json.dumps(s, indent=1) if a.json else "no cluster is up")
        return 0 if s["up"] else 1
    print(f"cluster {s['name']} ({'healthy' if s['healthy'] else 'DEGRADED'}): {s['subnet']}, "
          f"links {s['link_gbit']:g} Gbit/s")  # fmt: skip
    for n in s["nodes"]:
        print(f"  {n['node']}  {n['addr']:15s} netns {n['netns'] or 'GONE':14s} link {n['link']:7s}"
              f" procs {n['procs']:3d}  {n['shaping']}")  # fmt: skip
    return 0


def _run(a: argparse.Namespace) -> int:
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    return nodes.run(require(a.state_dir), a.node, cmd)


def _node_action(a: argparse.Namespace) -> int:
    st = require(a.state_dir)
    if a.action == "kill":
        print(f"{a.node}: killed {nodes.kill_node(st, a.node)} processes")
    elif a.action == "remove":
        nodes.remove_node(st, a.node)
        print(f"{a.node}: namespace removed; `wanka cluster start-node {a.node}` brings it back")
    elif a.action == "start":
        nodes.start_node(st, a.node, a.state_dir)
        print(f"{a.node}: up, link restored")
    else:
        nodes.set_link(st, a.node, a.action == "restore")
        print(f"{a.node}: link {'restored' if a.action == 'restore' else 'cut'}")
    return 0


def _launch(a: argparse.Namespace) -> int:
    args = a.wanka_args[1:] if a.wanka_args[:1] == ["--"] else a.wanka_args
    if not args:
        raise ValueError("nothing to launch: wanka cluster launch --nproc P -- train CONFIG ...")
    if a.nproc < 1:
        raise ValueError(f"--nproc must be 1 or more (got {a.nproc}): ranks per node")
    return launch.launch_on_cluster(a.nproc, args, a.state_dir)


def add_cluster_parser(subparsers: argparse._SubParsersAction) -> None:
    """`wanka cluster up|down|status|run|launch|kill-node|remove-node|start-node|cut-link|
    restore-link`."""
    c = subparsers.add_parser("cluster", help="cluster-in-a-box: N nodes as network namespaces")
    sub = c.add_subparsers(dest="cluster_cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", default=None,
                        help="default: $WANKA_CLUSTER_STATE or /run/wanka-cluster")  # fmt: skip

    u = sub.add_parser("up", parents=[common], help="create N nodes on a shaped private network")
    u.add_argument("--nodes", type=int, default=2, help="network namespaces to create")
    u.add_argument("--link-gbit", type=float, default=1.0, help="inter-node link rate")
    u.add_argument("--intra-gbit", type=float, default=None,
                   help="shape intra-node loopback too (default: unshaped)")  # fmt: skip
    u.add_argument("--name", default="wk", help="prefix of every name made (1-6 chars)")
    u.add_argument("--subnet", default=testbed.DEFAULT_SUBNET, help="private IPv4 subnet")
    u.set_defaults(fn=_up)
    sub.add_parser("down", parents=[common], help="remove everything `up` made").set_defaults(
        fn=_down
    )
    s = sub.add_parser("status", parents=[common], help="nodes, links, shaping, processes")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=_status)

    r = sub.add_parser("run", parents=[common], help="run a command inside a node")
    r.add_argument("node", help="node name, e.g. n0")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    r.set_defaults(fn=_run)
    la = sub.add_parser("launch", parents=[common], help="`wanka ARGS` as one job on all nodes")
    la.add_argument("--nproc", type=int, default=1, help="ranks per node")
    la.add_argument("wanka_args", nargs=argparse.REMAINDER, help="-- train CONFIG --set ...")
    la.set_defaults(fn=_launch)
    for name, action, text in (
        ("kill-node", "kill", "SIGKILL every process of a node (its namespace stays)"),
        ("remove-node", "remove", "kill a node and delete its namespace (hardware loss)"),
        ("start-node", "start", "bring a node back (re-create it if removed, restore its link)"),
        ("cut-link", "cut", "take a node's link down"),
        ("restore-link", "restore", "bring a node's link back up"),
    ):
        p = sub.add_parser(name, parents=[common], help=text)
        p.add_argument("node", help="node name, e.g. n1")
        p.set_defaults(fn=_node_action, action=action)


def _bench_net(a: argparse.Namespace) -> int:
    from wanka.bench.net import bench_net_main

    return bench_net_main(link_gbit=a.link_gbit, sizes=a.sizes, out=a.out, quick=a.quick,
                          nproc=a.nproc, nodes=a.nodes)  # fmt: skip


def add_bench_net_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """`wanka bench net`: collective bandwidth/latency intra- vs inter-node (own cluster)."""
    b = bench_subparsers.add_parser("net", help="all-reduce/all-gather/all-to-all across nodes")
    b.add_argument("--link-gbit", type=float, default=1.0, help="shaped inter-node link speed")
    b.add_argument("--sizes", default=None, help="message sizes, e.g. 4K,1M,64M")
    b.add_argument("--nodes", type=int, default=2, help="nodes to benchmark across")
    b.add_argument("--nproc", type=int, default=2, help="ranks per node")
    b.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    b.add_argument("--out", default="runs/bench/net.json", help="JSON result file")
    b.set_defaults(fn=_bench_net)
