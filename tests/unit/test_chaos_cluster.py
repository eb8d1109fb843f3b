"""Cluster faults of the chaos driver (node_kill takes the node, link_cut cuts and restores its
link) and the drill's check that each fault was named with the node it struck."""

from __future__ import annotations

import time

import pytest

from wanka.resilience import chaos
from wanka.resilience.chaos import ChaosDriver, parse_schedule
from wanka.resilience.drill import format_drill, injected_faults
from wanka.resilience.heartbeat import Beat


class Timeline:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, kind, t0, t1, **kw) -> None:
        self.events.append((kind, {"t0": t0, "t1": t1, **kw}))


class Nodes:
    """Stands in for cluster.nodes.NodeActions: records what the driver did to which node."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def kill_node(self, node: str) -> int:
        if node == "n9":
            raise ValueError("unknown node n9")
        self.calls.append(("kill", node))
        return 0

    def set_link(self, node: str, up: bool) -> None:
        if node == "n9":
            raise ValueError("unknown node n9")
        self.calls.append(("link", node, up))


def beats(step: int, pids: dict[int, int]) -> dict[int, Beat]:
    now = time.time()
    return {r: Beat(r, pid, 0, step, "forward", now, now, {}) for r, pid in pids.items()}


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("link_cut@t=5", "node=N"),
        ("link_cut@t=5,node=1,rank=0", "unknown parameter 'rank'"),
        ("link_cut@t=5,node=1,ms=3", "unknown parameter 'ms'"),
        ("link_cut@t=5,node=1,for=0", "for > 0"),
        ("node_kill@t=5,node=-1", "node must be >= 0"),
        ("node_kill@t=5,node=1,for=3", "unknown parameter 'for'"),
        ("link_cut@node=1", "say when"),
    ],
)
def test_bad_cluster_faults_are_refused_in_one_line(text, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_schedule(text)
    assert "\n" not in str(e.value)


def test_link_cut_cuts_then_restores_and_marks_the_nodes_ranks_injected(tmp_path):
    tl, nodes = Timeline(), Nodes()
    driver = ChaosDriver(parse_schedule("link_cut@step=3,node=1,for=0.3"), tmp_path, "job",
                         str(tmp_path / "snap"), tl)  # fmt: skip
    driver.cluster = nodes
    where = {0: "n0", 1: "n1"}.get
    driver.poll(beats(1, {0: 1, 1: 2}), time.time(), 1, node_of=where)
    assert nodes.calls == []  # not due yet
    driver.poll(beats(2, {0: 1, 1: 2}), time.time(), 1, node_of=where)
    assert nodes.calls == [("link", "n1", False)]
    assert 1 in driver.fired_rank and 0 not in driver.fired_rank  # n1's ranks were hit
    assert driver.fault_time(0) is not None  # but while the cut lasts, anything may follow
    [(kind, ev)] = tl.events
    assert (
        kind == "chaos" and ev["node"] == "n1" and ev["fault"] == "link_cut@step=3,node=1,for=0.3"
    )
    driver.poll({}, time.time(), 1, node_of=where)  # a poll with no ranks (between attempts)
    assert len(nodes.calls) == 1  # still cut
    time.sleep(0.35)
    driver.poll({}, time.time(), 1, node_of=where)
    assert nodes.calls[-1] == ("link", "n1", True)
    assert tl.events[-1][1]["released"] is True
    driver.poll(beats(9, {0: 1, 1: 2}), time.time(), 1, node_of=where)
    assert len(nodes.calls) == 2  # fired once


def test_cut_links_are_restored_when_the_job_ends_early(tmp_path):
    nodes = Nodes()
    driver = ChaosDriver(parse_schedule("link_cut@step=1,node=0,for=600"), tmp_path, "job",
                         str(tmp_path / "snap"), Timeline())  # fmt: skip
    driver.cluster = nodes
    driver.poll(beats(0, {0: 1}), time.time(), 1, node_of=lambda r: "n0")
    driver.close()
    assert nodes.calls == [("link", "n0", False), ("link", "n0", True)]


def test_link_cut_without_a_cluster_or_of_an_unknown_node_is_not_injected(tmp_path, capsys):
    for cluster in (None, Nodes()):
        driver = ChaosDriver(parse_schedule("link_cut@step=1,node=9"), tmp_path, "job",
                             str(tmp_path / "snap"), Timeline())  # fmt: skip
        driver.cluster = cluster
        driver.poll(beats(0, {0: 1}), time.time(), 1, node_of=lambda r: "n0")
        driver.poll(beats(1, {0: 1}), time.time(), 1, node_of=lambda r: "n0")
        assert driver.fired and not driver.cuts  # given up, never retried
    err = capsys.readouterr().err
    assert "need a --cluster job" in err and "unknown node n9" in err


def test_node_kill_on_a_cluster_takes_the_whole_node(tmp_path, monkeypatch):
    nodes, tl = Nodes(), Timeline()
    driver = ChaosDriver(parse_schedule("node_kill@step=1,node=1"), tmp_path, "job",
                         str(tmp_path / "snap"), tl)  # fmt: skip
    driver.cluster = nodes
    driver.poll(beats(0, {0: 1}), time.time(), 1, node_of=lambda r: "n0")  # rank 0 lives
    assert nodes.calls == [("kill", "n1")] and tl.events[0][1]["node"] == "n1"
    t = tl.events[0][1]["t0"]
    # What the node does next (lost at the restart, failing to start) is the fault's doing for
    # a while, not the node's own fault; rank 0 on n0 was not hit.
    assert t <= driver.fault_time(None, "n1") <= time.time()
    assert driver.fault_time(None, "n0") is None and driver.fault_time(0, "n0") is None
    later = time.time() + chaos.NODE_FAULT_AFTER_S + 1
    monkeypatch.setattr(chaos.time, "time", lambda: later)
    assert driver.fault_time(None, "n1") is None  # a real fault of n1, a minute later


def test_node_kill_of_an_unknown_node_is_given_up_once(tmp_path, capsys):
    nodes = Nodes()
    driver = ChaosDriver(parse_schedule("node_kill@step=1,node=9"), tmp_path, "job",
                         str(tmp_path / "snap"), Timeline())  # fmt: skip
    driver.cluster = nodes
    for _ in range(3):
        driver.poll(beats(0, {0: 1}), time.time(), 1, node_of=lambda r: "n0")
    assert driver.fired and nodes.calls == []
    assert capsys.readouterr().err.count("not injected: unknown node n9") == 1


def test_a_cut_link_makes_any_nodes_fault_injected_until_restored(tmp_path):
    nodes = Nodes()
    driver = ChaosDriver(parse_schedule("link_cut@step=1,node=0,for=0.2"), tmp_path, "job",
                         str(tmp_path / "snap"), Timeline())  # fmt: skip
    driver.cluster = nodes
    driver.poll(beats(0, {0: 1, 1: 2}), time.time(), 1, node_of={0: "n0", 1: "n1"}.get)
    # n0 holds the store: its cut makes n1 look lost, and n1's ranks look hung.
    assert driver.fault_time(None, "n1") is not None and driver.fault_time(1, "n1") is not None
    time.sleep(0.25)
    driver.restore_due()  # between attempts, nobody polls
    assert nodes.calls[-1] == ("link", "n0", True)
    assert driver.fault_time(None, "n1") is None and driver.fault_time(None, "n0") is not None


def test_sigterm_reaches_every_launcher_of_the_job(tmp_path):
    import subprocess

    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    driver = ChaosDriver(parse_schedule("sigterm@step=1"), tmp_path, "job", str(tmp_path / "snap"),
                         Timeline(), job_pid=procs[0].pid)  # fmt: skip
    driver.job_pids = [p.pid for p in procs]
    driver.poll(beats(1, {0: 1}), time.time(), 1, node_of=lambda r: "n0")
    assert [p.wait(timeout=5) for p in procs] == [-15, -15]


def test_drill_rows_say_where_the_fault_struck_and_where_it_was_named(tmp_path):
    ev = [{"kind": "step", "t0": float(s), "t1": s + 0.9, "step": s} for s in range(6)]
    ev += [{"kind": "chaos", "t0": 2.05, "t1": 2.05, "fault": "kill@step=3,rank=1", "node": "n1"},
           {"kind": "fault", "t0": 2.05, "t1": 2.1, "cause": "process_crash", "node": "n1"},
           {"kind": "chaos", "t0": 4.05, "t1": 4.05, "fault": "link_cut@step=5,node=1", "node": "n1"},
           {"kind": "fault", "t0": 4.05, "t1": 4.5, "cause": "hang", "node": "n0"},
           {"kind": "chaos", "t0": 4.05, "t1": 9.0, "fault": "link_cut@step=5,node=1",
            "node": "n1", "released": True}]  # fmt: skip
    kill, cut = injected_faults(ev, "kill@step=3,rank=1;link_cut@step=5,node=1", tmp_path)
    assert (kill["node"], kill["named_node"], kill["detected_as"]) == ("n1", "n1", "process_crash")
    assert (cut["node"], cut["named_node"], cut["detected_as"]) == ("n1", "n0", "hang")


def test_a_node_fault_on_a_hot_spare_is_marked_not_missed(tmp_path):
    """A link cut of a node that trained no rank then (a hot spare after a replacement):
    the chaos event says so, and the drill row is `spare`, not an undetected fault."""
    tl, nodes = Timeline(), Nodes()
    driver = ChaosDriver(parse_schedule("link_cut@step=3,node=2,for=0.1"), tmp_path, "job",
                         str(tmp_path / "snap"), tl)  # fmt: skip
    driver.cluster = nodes
    driver.attempt_nodes = {"n0", "n1"}  # the supervisor's attempt: n2 stands by
    driver.poll(beats(3, {0: 1, 1: 2}), time.time(), 1, node_of={0: "n0", 1: "n1"}.get)
    [(kind, ev)] = tl.events
    assert kind == "chaos" and ev["node"] == "n2" and ev["training"] is False
    steps = [{"kind": "step", "t0": float(s), "t1": s + 0.9, "step": s} for s in range(6)]
    spare = {**ev, "kind": "chaos", "t0": 3.05, "t1": 3.05}
    [row] = injected_faults([*steps, spare], "link_cut@step=3,node=2,for=0.1", tmp_path)
    assert row["training"] is False and row["detected"] is False
    result = {"schedule": "s", "cluster": True,
              "runs": {"wanka": {"wall_s": 1.0, "submissions": 1, "state_equal": True, "rc": 0,
                                 "injected": [row]}}}  # fmt: skip
    assert format_drill(result).splitlines()[4].split()[:3] == ["link_cut", "n2", "spare"]
    # A node with ranks on it: training.
    tl2 = Timeline()
    d2 = ChaosDriver(parse_schedule("link_cut@step=3,node=1,for=0.1"), tmp_path / "b", "job",
                     str(tmp_path / "snap"), tl2)  # fmt: skip
    d2.cluster = Nodes()
    d2.attempt_nodes = {"n0", "n1"}
    d2.poll(beats(3, {0: 1, 1: 2}), time.time(), 1, node_of={0: "n0", 1: "n1"}.get)
    assert tl2.events[0][1]["training"] is True
    d2.close()
    driver.close()


def test_a_fault_on_a_spare_does_not_cut_short_the_last_real_faults_window(tmp_path):
    """A hang named after a spare's link cut belongs to the SIGSTOP before it: the spare's
    row takes no detection and is not judged by a limit."""
    steps = [{"kind": "step", "t0": float(s), "t1": s + 0.9, "step": s} for s in range(9)]
    ev = [*steps,
          {"kind": "chaos", "t0": 2.05, "t1": 2.05, "fault": "stop@step=3,rank=1", "node": "n1"},
          {"kind": "chaos", "t0": 3.0, "t1": 3.0, "fault": "link_cut@step=4,node=2",
           "node": "n2", "training": False},
          {"kind": "fault", "t0": 2.05, "t1": 6.0, "cause": "hang", "node": "n1", "limit_s": 4.0}]  # fmt: skip
    stop, cut = injected_faults(ev, "stop@step=3,rank=1;link_cut@step=4,node=2", tmp_path)
    assert stop["detected"] and stop["named_node"] == "n1" and stop["within_limit"] is True
    assert not cut["training"] and not cut["detected"] and cut["within_limit"] is None
