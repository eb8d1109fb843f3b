"""resilience/cluster_attempt.py without namespaces: each node's launcher is a local stand-in
process that reads its orders and then does what the test says (exit with a code, wait to be
killed), so the attempt's bookkeeping is tested on real processes: which node failed first and
with what, warm spares taken, retired and dismissed, every launcher torn down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from wanka.cluster.state import ClusterState, Node
from wanka.resilience import cluster_attempt as ca

NODES = [Node(f"n{i}", f"ns{i}", f"h{i}", f"v{i}", f"10.9.0.{i + 1}") for i in range(2)]
STATE = ClusterState("t", "10.9.0.0/24", "br", 1.0, None, list(NODES))

# A stand-in launcher: its orders' argv[0] says what to do once they arrive.
STAND_IN = """
import json, os, sys, time
orders = sys.stdin.readline()
if not orders.strip():
    time.sleep(float(os.environ.get("DISMISS_S", "0")))  # a launcher's exit after import torch
    sys.exit(0)
what = json.loads(orders)["argv"][0]
with open(os.environ["ORDERS_LOG"], "a") as f:
    f.write(f"{os.getpid()} {what}\\n")
if what.startswith("exit"):
    time.sleep(float(what.split(":")[2]))
    sys.exit(int(what.split(":")[1]))
time.sleep(60)
"""


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """start_launcher replaced by a local process; argv per node from `plan`."""
    started: list[tuple[str, int, subprocess.Popen]] = []
    log = tmp_path / "orders.log"
    monkeypatch.setenv("ORDERS_LOG", str(log))

    def start(node, attempt, log_dir, launcher=None):
        p = subprocess.Popen([sys.executable, "-c", STAND_IN], stdin=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
        started.append((node.name, attempt, p))
        return p

    monkeypatch.setattr(ca, "start_launcher", start)
    yield started, log
    for _, _, p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def attempt(plan: dict[str, str], warm=None, stop=None, started=None, attempt_no=1):
    """Run one attempt where node n gets orders argv [plan[n]] (a per-node argv is the test's
    way to tell stand-ins apart: run_attempt gives every node the same worker argv)."""
    orders_for = {}
    real_take = (warm or ca.WarmLaunchers(None)).take

    def take(a, node):
        orders_for[node.name] = plan[node.name]
        return real_take(a, node)

    w = warm or ca.WarmLaunchers(None)
    w.take = take
    real_give = ca._give_orders

    def give(p, orders):
        node = next(n for n, q in orders_for.items() if q is not None)
        orders_for[node] = None
        return real_give(p, {**orders, "argv": [plan[node]]})

    ca._give_orders = give
    try:
        return ca.run_attempt(STATE, NODES, 1, ["train"], {}, attempt_no, stop or threading.Event(),
                              threading.Event(), warm=w, started=started)  # fmt: skip
    finally:
        ca._give_orders = real_give


def test_a_killed_launcher_is_the_failed_node_and_its_peer_is_torn_down(stand_ins):
    started, log = stand_ins
    kill_n1 = threading.Thread(target=lambda: _kill_when_ready(started, "n1", log))
    kill_n1.start()
    # n0 would exit 1 (its rank lost its peer) just after n1's launcher is killed.
    end = attempt({"n0": "exit:1:0.6", "n1": "wait"})
    kill_n1.join()
    assert end.failed == "n1" and end.own_code == -signal.SIGKILL and end.t_failed is not None
    assert end.codes == [-signal.SIGKILL, -signal.SIGKILL]  # n0 torn down from here
    assert all(p.poll() is not None for _, _, p in started)


@pytest.mark.parametrize(
    ("codes", "first"),
    [
        ({"n0": 1, "n1": -9}, ("n1", -9)),  # the killed one, though n0 comes first
        ({"n0": -9, "n1": -15}, ("n0", -9)),  # node order among killed ones
        ({"n0": None, "n1": 1}, ("n1", 1)),
        ({"n0": 0, "n1": None}, (None, None)),
    ],
)
def test_first_failure_prefers_a_killed_launcher(codes, first):
    from types import SimpleNamespace

    procs = {n: SimpleNamespace(returncode=c) for n, c in codes.items()}
    assert ca._first_failure(procs) == first


def test_a_clean_end_names_nobody_and_every_launcher_is_gone(stand_ins):
    started, _ = stand_ins
    end = attempt({"n0": "exit:0:0.1", "n1": "exit:0:0.2"})
    assert end.codes == [0, 0] and end.failed is None and end.own_code is None
    assert all(p.poll() is not None for _, _, p in started)


def test_a_stop_tears_down_without_naming_a_node(stand_ins):
    started, _ = stand_ins
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    end = attempt({"n0": "wait", "n1": "wait"}, stop=stop)
    assert end.own_code is None and all(c == -signal.SIGKILL for c in end.codes)
    assert all(p.poll() is not None for _, _, p in started)


def test_warm_spares_are_used_retired_and_dismissed(stand_ins, monkeypatch):
    started, _ = stand_ins
    warm = ca.WarmLaunchers(None)
    warm.prepare(2, NODES)
    spares = {name: p for name, _, p in started}
    end = attempt({"n0": "exit:0:0.1", "n1": "exit:0:0.1"}, warm=warm, attempt_no=2)
    assert end.codes == [0, 0]
    assert len(started) == 2  # the spares took the orders: no cold launcher was started
    # Spares of an attempt a node is no longer in, and of older attempts, are let go; the next
    # attempt does not wait for them to exit (a launcher that imported torch takes ~1 s).
    monkeypatch.setenv("DISMISS_S", "3")
    warm.prepare(3, NODES)
    t0 = time.monotonic()
    warm.retire(3, NODES[:1])
    warm.discard("n0")
    assert time.monotonic() - t0 < 2.0 and not warm.ready
    dismissed = [p for _, a, p in started if a == 3]
    assert len(dismissed) == 2 and all(p.poll() is None for p in dismissed)  # still exiting
    warm.close()  # the supervisor's end: every dismissed launcher reaped
    assert all(p.poll() == 0 for p in dismissed)  # dismissed by EOF: exited on their own
    assert all(p.poll() == 0 for p in spares.values())


def test_a_dead_spare_is_replaced_by_a_cold_launcher(stand_ins):
    started, _ = stand_ins
    warm = ca.WarmLaunchers(None)
    warm.prepare(2, NODES)
    n1_spare = next(p for name, _, p in started if name == "n1")
    os.killpg(n1_spare.pid, signal.SIGKILL)  # a node_kill took it with its node
    n1_spare.wait()
    end = attempt({"n0": "exit:0:0.1", "n1": "exit:0:0.1"}, warm=warm, attempt_no=2)
    assert end.codes == [0, 0] and len(started) == 3


def test_the_next_attempts_launchers_start_once_the_ranks_train(stand_ins):
    started, _ = stand_ins
    warm = ca.WarmLaunchers(None)
    end = attempt({"n0": "exit:0:0.5", "n1": "exit:0:0.5"}, warm=warm, started=lambda: True)
    assert end.codes == [0, 0]
    assert sorted(warm.ready) == [(2, "n0"), (2, "n1")]
    warm.close()
    assert not warm.ready


def test_no_launchers_start_ahead_with_warm_launchers_off(stand_ins, monkeypatch):
    """resilience.warm_launchers = false: the ranks train and nothing starts for the next
    attempt (it starts its launchers cold), spares included."""
    started, _ = stand_ins
    warm = ca.WarmLaunchers(None)
    real_give = ca._give_orders
    monkeypatch.setattr(
        ca, "_give_orders", lambda p, o: real_give(p, {**o, "argv": ["exit:0:0.5"]})
    )
    end = ca.run_attempt(STATE, NODES, 1, ["train"], {}, 1, threading.Event(), threading.Event(),
                         warm=warm, started=lambda: True, spares=_nodes("n2"), prewarm=False)  # fmt: skip
    assert end.codes == [0, 0] and not warm.ready
    assert sorted(name for name, _, _ in started) == ["n0", "n1"]  # this attempt's only


def _kill_when_ready(started, node: str, log) -> None:
    """SIGKILL `node`'s launcher once it has its orders (as a node_kill would, mid-attempt)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        pids = {int(x.split()[0]) for x in lines if x.endswith("wait")}
        mine = [p for name, _, p in started if name == node and p.pid in pids]
        if mine:
            time.sleep(0.3)
            os.kill(mine[0].pid, signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError(f"{node}'s launcher never got its orders")


def test_orders_are_one_json_line(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import sys; print(sys.stdin.read(), end='')"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    assert ca._give_orders(p, {"argv": ["a"], "env": {"K": "v"}})
    out = p.stdout.read().decode()
    p.wait()
    assert out.endswith("\n") and json.loads(out) == {"argv": ["a"], "env": {"K": "v"}}


def _nodes(*names: str) -> list[Node]:
    return [Node(n, f"ns-{n}", f"h-{n}", f"v-{n}", "10.9.0.9") for n in names]


@pytest.mark.parametrize(
    "active, prev, width, suspect, chosen",
    [
        ("n0 n1 n2", "", 2, None, "n0 n1"),  # the first attempt: the first `width` nodes
        ("n0 n1 n2", "n0 n1", 2, None, "n0 n1"),  # no node suspect: the same nodes
        # A lost node's place goes to the spare; the first node still hosts the rendezvous.
        ("n0 n1 n2", "n0 n1", 2, "n1", "n0 n2"),
        ("n0 n1 n2", "n0 n1", 2, "n0", "n2 n1"),
        ("n0 n1 n2", "n0 n2", 2, "n2", "n0 n1"),  # the node it replaced is the spare now
        ("n0 n1", "n0 n1", 2, "n1", "n0 n1"),  # no spare: the suspect stays (it may be back)
        ("n0 n2", "n0 n1", 2, None, "n0 n2"),  # n1 evicted: the spare takes its place
        ("n0", "n0 n1", 2, None, "n0"),  # evicted, no spare: the job shrinks
        ("n0 n1 n2 n3", "n0 n1", 2, "n1", "n0 n2"),  # spares in cluster order
        ("n0 n1 n2", "n0 n1", 1, None, "n0"),  # never wider than asked
    ],
)
def test_a_spare_takes_the_place_of_a_suspect_or_evicted_node(active, prev, width, suspect,
                                                              chosen):  # fmt: skip
    got = ca.choose_nodes(_nodes(*active.split()), prev.split(), width, suspect)
    assert [n.name for n in got] == chosen.split()


def test_the_next_attempts_launchers_also_wait_on_the_spare_nodes(stand_ins, monkeypatch):
    started, _ = stand_ins
    warm = ca.WarmLaunchers(None)
    spare = _nodes("n2")
    real_give = ca._give_orders
    monkeypatch.setattr(
        ca, "_give_orders", lambda p, o: real_give(p, {**o, "argv": ["exit:0:0.5"]})
    )
    end = ca.run_attempt(STATE, NODES, 1, ["train"], {}, 1, threading.Event(), threading.Event(),
                         warm=warm, started=lambda: True, spares=spare)  # fmt: skip
    assert end.codes == [0, 0]
    assert sorted(warm.ready) == [(2, "n0"), (2, "n1"), (2, "n2")]
    warm.close()


def test_the_launchers_hook_runs_once_when_the_ranks_train_and_not_before(stand_ins, monkeypatch):
    started, _ = stand_ins
    trained = threading.Event()
    calls: list[list[str]] = []

    class Launcher:  # the control store's side of an attempt (store_attempt.StoreControl)
        env = staticmethod(lambda node, env, attempt: env)
        orders = staticmethod(lambda orders: orders)

        @staticmethod
        def kill(name, p):
            if p.poll() is None:
                p.kill()

        @staticmethod
        def when_training(nodes):
            calls.append([n.name for n in nodes])

    real_give = ca._give_orders
    monkeypatch.setattr(
        ca, "_give_orders", lambda p, o: real_give(p, {**o, "argv": ["exit:0:1.5"]})
    )
    threading.Timer(0.7, lambda: (calls.append(["before"]), trained.set())).start()
    end = ca.run_attempt(STATE, NODES, 1, ["train"], {}, 1, threading.Event(), threading.Event(),
                         launcher=Launcher, warm=ca.WarmLaunchers(None), started=trained.is_set,
                         spares=_nodes("n2"))  # fmt: skip
    assert end.codes == [0, 0]
    # Spawned once the ranks train (the timer's mark comes first), once, spares included.
    assert calls == [["before"], ["n0", "n1", "n2"]]


def test_a_node_that_cannot_start_a_launcher_ahead_leaves_the_others_theirs(stand_ins, monkeypatch):
    started, _ = stand_ins
    real = ca.start_launcher

    def start(node, attempt, log_dir, launcher=None):
        if node.name == "n0":
            raise OSError("netns gone")
        return real(node, attempt, log_dir, launcher)

    monkeypatch.setattr(ca, "start_launcher", start)
    warm = ca.WarmLaunchers(None)
    warm.prepare(2, NODES)
    assert sorted(warm.ready) == [(2, "n1")]
    warm.close()


def test_an_attempt_uses_torchruns_static_rendezvous_with_node_i_as_node_rank_i():
    from torch.distributed.run import config_from_args, parse_args

    from wanka.cluster.launch import torchrun_options

    nodes = [NODES[1], NODES[0]]  # the supervisor's order, not the addresses'
    for i, node in enumerate(nodes):
        config, _, _ = config_from_args(parse_args([
            *torchrun_options(STATE, i, 2, "wanka-x", 29400, nodes, static=True), "x"]))  # fmt: skip
        assert config.rdzv_backend == "static" and config.rdzv_configs["rank"] == i
        assert config.rdzv_endpoint == f"{nodes[0].addr}:29400"  # the first node hosts it
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
        assert config.local_addr == node.addr
        assert int(config.rdzv_configs["timeout"]) == 120  # not torchrun's 900 s


@pytest.mark.parametrize("warm_launchers, preflight, forks, cluster, expect", [
    (True, "static", True, True, True),
    (False, "static", True, True, False),  # resilience.warm_launchers = false: cold, later
    (True, "full", True, True, False),  # a full pre-flight's timed checks get the CPUs alone
    (True, "static", False, True, False),  # spawning ranks gain nothing from a warm import
    (True, "static", True, False, False),  # a single-node job has no node launchers
])  # fmt: skip
def test_the_first_attempts_launchers_start_under_the_preflight_only_when_warm(
    monkeypatch, tmp_path, warm_launchers, preflight, forks, cluster, expect
):
    import types

    from wanka.resilience.supervisor import Supervisor

    prepared = []
    monkeypatch.setattr(ca.WarmLaunchers, "prepare",
                        lambda self, attempt, nodes: prepared.append((attempt, [n.name for n in nodes])))  # fmt: skip
    sup = types.SimpleNamespace(
        cluster=STATE if cluster else None,
        _forks=lambda: forks,
        run_dir=tmp_path,
        control=None,
        rc=types.SimpleNamespace(preflight=preflight, warm_launchers=warm_launchers),
        attempt_nodes=lambda: list(NODES),
        _warm=None,
    )
    Supervisor._start_first_launchers(sup)
    assert prepared == ([(1, ["n0", "n1"])] if expect else [])
    assert (sup._warm is not None) == expect


@pytest.mark.parametrize("cluster", [True, False])
def test_a_launcher_still_running_after_the_named_fault_is_stopped(monkeypatch, cluster):
    """Ranks that exited 0 mid-job leave torch's agent waiting for their return values. Once
    the watch named the fault: on the cluster it sets `stop` (run_attempt then kills the node
    launchers), on one host it asks for this host's launcher to be stopped (its own SIGTERM)."""
    import threading
    import types

    from wanka.resilience import supervisor as sv

    monkeypatch.setattr(sv, "UNSTICK_AFTER_S", 0.2)
    monkeypatch.setattr(sv, "HangMonitor", lambda timeouts: None)
    stopped = []
    sup = types.SimpleNamespace(cluster=STATE if cluster else None, timeouts=None,
                                _poll=lambda *a: True,
                                stop_stuck_launcher=lambda: stopped.append(1))  # fmt: skip
    stop = threading.Event()
    t = threading.Thread(target=sv.Supervisor._watch, args=(sup, None, 1, None, stop))
    t.start()
    t.join(5)
    assert not t.is_alive()
    assert stop.is_set() == cluster and stopped == ([] if cluster else [1])
