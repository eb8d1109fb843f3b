"""Cluster-in-a-box: lifecycle leaves nothing behind, addresses stay inside our namespaces,
gloo spans nodes through torchrun, shaping is in effect, nodes can be killed/cut/restored."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wanka.bench.net import parse_sizes, table
from wanka.cluster import netns as nx
from wanka.cluster import nodes as nd
from wanka.cluster import testbed
from wanka.cluster.cli import add_bench_net_parser, add_cluster_parser
from wanka.cluster.fixtures import cluster_up, skip_unless_available
from wanka.cluster.state import require

# Sender/receiver of N bytes over TCP; the sender prints the seconds the transfer took.
XFER = """
import socket, sys, time
role, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "recv":
    s = socket.create_server((host, 5999)); c, _ = s.accept(); got = 0
    while got < n:
        got += len(c.recv(1 << 20))
    c.sendall(b"k")
else:
    c = socket.create_connection((host, 5999), timeout=2); t = time.time()
    c.sendall(b"x" * n); c.recv(1); print(time.time() - t)
"""


def leftovers(name: str) -> list[str]:
    ns, links = testbed._leftovers(name)
    qd = [x["ifname"] for x in nx.links() if x["ifname"].startswith(name) and "tbf" in x["qdisc"]]
    memory = [str(p) for p in [Path(nd.NODES_SHM) / name] if p.exists()]  # the nodes' memory
    return ns + links + qd + memory


def transfer_seconds(c, src: str, dst: str, nbytes: int, dst_addr: str | None = None) -> float:
    addr = dst_addr or c.node(dst).addr
    recv = c.popen(dst, [sys.executable, "-c", XFER, "recv", addr, str(nbytes)])
    try:
        for _ in range(50):  # until the receiver listens
            r = c.run(src, [sys.executable, "-c", XFER, "send", addr, str(nbytes)])
            if r.returncode == 0:
                return float(r.stdout)
            time.sleep(0.1)
        raise AssertionError(f"transfer {src}->{dst} failed: {r.stderr.strip()[-200:]}")
    finally:
        recv.wait(timeout=30)


# ---- no root needed ----


def test_cli_wiring_and_sizes(tmp_path):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    add_cluster_parser(sub)
    add_bench_net_parser(sub.add_parser("bench").add_subparsers(dest="bench_cmd"))
    a = p.parse_args(["cluster", "up", "--nodes", "3", "--link-gbit", "2"])
    assert (a.nodes, a.link_gbit, callable(a.fn)) == (3, 2.0, True)
    a = p.parse_args(["cluster", "run", "n1", "--", "echo", "hi"])
    assert a.node == "n1" and a.command[-2:] == ["echo", "hi"] and a.cmd == "cluster"
    assert callable(p.parse_args(["bench", "net", "--quick"]).fn)
    assert parse_sizes("4K,64KiB,1M") == [4096, 65536, 1 << 20]
    with pytest.raises(ValueError, match="bad --sizes"):
        parse_sizes("4Q")
    with pytest.raises(ValueError, match="no cluster is up"):
        require(tmp_path)
    row = {"lat_us": 1.0, "busbw_gbit": 1.0}
    res = {"link_gbit": 1.0, "sizes": [4096], "rows": [
        dict(row, op="all_reduce", scope=s, bytes=4096) for s in ("intra", "inter")]}  # fmt: skip
    assert "| all_reduce | 4 KiB |" in table(res)


# ---- the testbed (root + iproute2) ----


def test_up_down_idempotent_and_clean(tmp_path, monkeypatch):
    skip_unless_available()
    name, subnet, sdir = "wki", "10.231.4.0/24", str(tmp_path)
    st = testbed.up(2, 1.0, name=name, subnet=subnet, sdir=sdir)
    assert testbed.up(2, 1.0, name=name, subnet=subnet, sdir=sdir) == st  # no-op when healthy
    sleeper = testbed.names(name, 1)
    # A crashed job: a process still in a node, and a different request -> clean re-create.
    c = nd.popen(st.nodes[1], ["sleep", "60"])
    st2 = testbed.up(3, 0.5, name=name, subnet=subnet, sdir=sdir)
    assert c.wait(timeout=10) == -9 and len(st2.nodes) == 3
    assert nx.qdisc(sleeper.veth_host).startswith("tbf rate 500Mbit")
    # A crash that lost the state file: the next `up` recognises our names and cleans them.
    (tmp_path / "cluster.json").unlink()
    testbed.up(2, 1.0, name=name, subnet=subnet, sdir=sdir)
    assert testbed.status(sdir)["healthy"]
    assert sorted(testbed.down(sdir)) == sorted(
        ["wki-br", "wki-n0h", "wki-n1h", "wanka-wki-n0", "wanka-wki-n1"])  # fmt: skip
    assert testbed.down(sdir) == [] and leftovers(name) == []
    # Failing half-way through `up` leaves nothing either.
    monkeypatch.setattr(nx, "shape", lambda *a, **k: (_ for _ in ()).throw(nx.ClusterError("x")))
    with pytest.raises(nx.ClusterError):
        testbed.up(2, 1.0, name=name, subnet=subnet, sdir=sdir)
    assert leftovers(name) == [] and testbed.status(sdir) == {"up": False}


def test_bad_input_is_one_line_valueerror(wanka_cluster):
    sdir = wanka_cluster.state_dir
    for kw, msg in (({"subnet": "8.8.8.0/24"}, "not private"), ({"name": "Bad_Name"}, "--name"),
                    ({"subnet": "10.231.5.0/30", "nodes": 4}, "too small")):  # fmt: skip
        args = {"nodes": 2, "name": "wkv", "sdir": sdir, **kw}
        with pytest.raises(ValueError, match=msg):
            testbed.up(args.pop("nodes"), **args)
    # Bad input changes nothing: the live cluster in that state dir is untouched.
    assert wanka_cluster.status()["healthy"] and leftovers("wkv") == []


def test_addresses_private_and_contained(wanka_cluster):
    st = wanka_cluster.state
    sub = st.subnet.split("/")[0].rsplit(".", 1)[0] + "."
    assert not [a for a in nx.addrs() if a.startswith(sub)]  # nothing in the root namespace
    assert not [r for r in nx.routes() if r.startswith(sub)]
    bridge = json.loads(nx.sh("ip", "-j", "addr", "show", "dev", st.bridge).stdout)
    assert bridge[0]["addr_info"] == []  # no IPv4, no IPv6 link-local: the bridge is L2 only
    for n in st.nodes:
        assert sorted(nx.addrs(n.netns)) == sorted(["127.0.0.1/8", f"{n.addr}/24"])
        assert nx.routes(n.netns) == [st.subnet]  # no default route: nowhere else to go
        links = {x["ifname"] for x in nx.links(n.netns)}
        assert links == {"lo", n.veth_node}


def test_gloo_allreduce_2_nodes_x_2_ranks(wanka_cluster, tmp_path):
    out = tmp_path / "probe.json"
    assert wanka_cluster.run_on_cluster(2, ["-m", "wanka.cluster.probe", str(out)]) == 0
    seen = json.loads(out.read_text())
    assert [s["sum"] for s in seen] == [10.0] * 4 and all(s["ok"] for s in seen)
    by_group = {}
    for s in seen:
        by_group.setdefault(s["group_rank"], set()).add(s["node"])
    assert sorted(by_group.values(), key=sorted) == [{"n0"}, {"n1"}]  # each agent = one node
    assert {s["master"] for s in seen} == {wanka_cluster.node("n0").addr}


def test_shaping_in_effect(wanka_cluster):
    rate = wanka_cluster.state.link_gbit * 1e9 / 8  # bytes/s
    nbytes = 24 << 20
    inter = transfer_seconds(wanka_cluster, "n0", "n1", nbytes)
    assert 0.8 * nbytes / rate < inter < 1.4 * nbytes / rate, (inter, nbytes / rate)
    intra = transfer_seconds(wanka_cluster, "n0", "n0", nbytes, dst_addr="127.0.0.1")
    assert intra < inter / 3, (intra, inter)  # loopback inside a node is not shaped


def test_kill_cut_restore(wanka_cluster):
    c = wanka_cluster
    p = c.popen("n1", ["sleep", "60"])
    assert c.status()["nodes"][1]["procs"] >= 1
    assert c.kill_node("n1") >= 1 and p.wait(timeout=5) == -9
    assert c.status()["nodes"][1]["netns"]  # the node is still there for a relaunch
    c.cut_link("n1")
    try:
        r = c.run("n0", [sys.executable, "-c", XFER, "send", c.node("n1").addr, "10"])
        assert r.returncode != 0  # timed out or unreachable
        assert c.status()["nodes"][1]["link"] == "cut"
    finally:
        c.restore_link("n1")
    assert transfer_seconds(c, "n0", "n1", 1 << 20) < 5
    c.remove_node("n1")
    assert not c.status()["healthy"]
    c.start_node("n1")
    assert c.status()["healthy"] and transfer_seconds(c, "n1", "n0", 1 << 20) < 5
    with pytest.raises(ValueError, match="unknown node"):
        c.kill_node("n9")


@pytest.mark.slow
def test_train_job_spans_nodes(tmp_path):
    skip_unless_available()
    from wanka.cluster.launch import launch_on_cluster

    with cluster_up(2, 1.0, name="wktr", subnet="10.231.6.0/24") as c:
        args = ["train", str(Path(__file__).parents[2] / "configs/demo.toml"), "--set", "train.steps=3", "--set", "parallel.ep=2",
                "--set", f'run.dir="{tmp_path}/run"', "--set", "run.tensorboard=false",
                "--set", f'data.cache_dir="{tmp_path}/cache"']  # fmt: skip
        assert launch_on_cluster(1, args, c.state_dir) == 0
        assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_context_parallel_inside_nodes_data_parallel_across(tmp_path):
    """2 nodes x 2 ranks, cp = 2: each CP group (consecutive ranks) sits inside a node, the dp
    groups span the link; the dynamic plan may widen a step's gather block across it."""
    skip_unless_available()
    from wanka.cluster.launch import launch_on_cluster

    with cluster_up(2, 1.0, name="wkcp", subnet="10.231.7.0/24") as c:
        sets = ["train.steps=3", "parallel.cp=2", "parallel.ep=2", "data.seq_len=256",
                f'run.dir="{tmp_path}/run"', "run.tensorboard=false",
                f'data.cache_dir="{tmp_path}/cache"']  # fmt: skip
        args = ["train", str(Path(__file__).parents[2] / "configs/demo.toml")]
        args += sum((["--set", s] for s in sets), [])
        assert launch_on_cluster(2, args, c.state_dir) == 0
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["world_size"] == 4
        assert summary["val_loss"] == summary["val_loss"]  # a number, not NaN
        log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
        assert "dp 2 x cp 2" in log


@pytest.mark.slow
def test_bench_net_quick_matches_link():
    skip_unless_available()
    from wanka.bench.net import run_bench

    res = run_bench(link_gbit=1.0, sizes=[16 << 20], quick=True)
    by = {(r["op"], r["scope"]): r["busbw_gbit"] for r in res["rows"]}
    assert 0.75 < by[("all_reduce", "inter")] < 1.1
    assert by[("all_reduce", "intra")] > 2 * by[("all_reduce", "inter")]


# Writes a marker into the node's /dev/shm and run-state folder, then lists both and the host's.
MEMORY = """
import os, sys
from pathlib import Path
name = sys.argv[1]
for d in ("/dev/shm", sys.argv[2]):
    Path(d, f"mark-{name}").write_text(name)
print(sorted(os.listdir("/dev/shm")), sorted(os.listdir(sys.argv[2])))
"""


def test_each_node_has_its_own_memory(wanka_cluster):
    """A node's /dev/shm and run-state folder are its own: another node cannot see them (only
    the network passes data between nodes), the host's /dev/shm is not them, and a node_kill
    empties them as a power loss would; the host keeps its own."""
    from wanka.cluster.state import NODE_LOCAL

    c = wanka_cluster
    host_shm = set(os.listdir("/dev/shm"))
    seen = {}
    for n in ("n0", "n1"):
        r = c.run(n, [sys.executable, "-c", MEMORY, n, NODE_LOCAL])
        assert r.returncode == 0, r.stderr
        seen[n] = r.stdout.strip()
    assert seen["n0"] == "['mark-n0'] ['mark-n0']" and seen["n1"] == "['mark-n1'] ['mark-n1']"
    assert set(os.listdir("/dev/shm")) == host_shm  # nothing landed in the host's
    assert not Path(NODE_LOCAL, "mark-n0").exists()
    # The environment says which host a process is on (NCCL's intra-node transports use it).
    r = c.run("n1", [sys.executable, "-c", "import os; print(os.environ['NCCL_HOSTID'])"])
    assert r.stdout.strip() == "n1"
    c.kill_node("n1")
    r = c.run("n1", [sys.executable, "-c", MEMORY, "again", NODE_LOCAL])
    assert r.stdout.strip() == "['mark-again'] ['mark-again']", r.stderr
    r = c.run("n0", [sys.executable, "-c", MEMORY, "n0", NODE_LOCAL])
    assert r.stdout.strip() == "['mark-n0'] ['mark-n0']", r.stderr  # n0's memory untouched


ABANDON = """
import os, signal, sys
from wanka.cluster.fixtures import cluster_up
with cluster_up(1, 1.0, name="wkab", subnet="10.231.9.0/24") as c:
    print(c.state_dir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a test run killed mid-test: nothing is taken down
"""


def test_cluster_left_up_by_a_killed_test_is_taken_down_by_the_next(tmp_path):
    """A test process killed inside cluster_up leaves its cluster up; the next cluster_up of
    that name (a rerun) takes it down instead of refusing the name, and a live owner keeps it."""
    skip_unless_available()
    r = subprocess.run([sys.executable, "-c", ABANDON], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    old = r.stdout.strip()
    assert r.returncode == -9 and old, r.stderr[-500:]
    try:
        assert testbed.owner_of("wkab") == str(Path(old).resolve())
        with cluster_up(1, 1.0, name="wkab", subnet="10.231.9.0/24") as c:
            assert c.state_dir != old and not Path(old).exists()
            assert testbed.owner_of("wkab") == str(Path(c.state_dir).resolve())
            # while its test process lives, another cluster_up of the name refuses as before
            with pytest.raises(ValueError, match="--name wkab is used"):
                with cluster_up(1, 1.0, name="wkab", subnet="10.231.9.0/24"):
                    pass
        assert leftovers("wkab") == []
    finally:
        if Path(old).exists():
            testbed.down(old)
            shutil.rmtree(old, ignore_errors=True)
