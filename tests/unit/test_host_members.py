"""Hot spares and in-job eviction across hosts (resilience/host_members.py, host_control.py):
which hosts train in each attempt, planned by the coordinator and carried out by the others,
against a real TCPStore in this process."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.unit.test_host_control import _free_port, fake_sup
from wanka.resilience import host_control as hc
from wanka.resilience.host_members import live_hosts, plan_members

HOSTS = ["n0", "n1", "n2", "n3"]


def test_first_attempt_trains_on_width_hosts_coordinator_first():
    live = set(HOSTS)
    assert plan_members(HOSTS, live, set(), [], 3, None, "n2") == ["n2", "n0", "n1"]


def test_a_spare_takes_the_place_of_a_lost_host_and_the_others_keep_theirs():
    prev = ["n0", "n1", "n2"]
    live = {"n0", "n2", "n3"}  # n1's supervisor stopped beating
    assert plan_members(HOSTS, live, set(), prev, 3, "n1", "n0") == ["n0", "n3", "n2"]
    # Still beating (a cut link, a hung rank): replaced all the same, it is the suspect.
    assert plan_members(HOSTS, set(HOSTS), set(), prev, 3, "n1", "n0") == ["n0", "n3", "n2"]


def test_an_evicted_host_gives_its_place_to_a_spare_or_the_job_shrinks():
    prev = ["n0", "n1", "n2"]
    assert plan_members(HOSTS, set(HOSTS), {"n2"}, prev, 3, None, "n0") == ["n0", "n1", "n3"]
    # No spare left: the job goes on without it.
    assert plan_members(HOSTS, set(HOSTS), {"n2", "n3"}, prev, 3, None, "n0") == ["n0", "n1"]


def test_without_a_spare_a_live_suspect_stays_and_a_dead_one_goes():
    prev = ["n0", "n1"]
    hosts = ["n0", "n1"]
    assert plan_members(hosts, {"n0", "n1"}, set(), prev, 2, "n1", "n0") == ["n0", "n1"]
    assert plan_members(hosts, {"n0"}, set(), prev, 2, "n1", "n0") == ["n0"]


def test_the_coordinators_host_always_trains():
    """torchrun's rendezvous store runs on it: a spare never replaces it, even as the suspect
    or when the ledger has evicted it."""
    prev = ["n0", "n1"]
    assert plan_members(HOSTS, set(HOSTS), set(), prev, 2, "n0", "n0") == ["n0", "n1"]
    assert plan_members(HOSTS, set(HOSTS), {"n0"}, prev, 2, None, "n0") == ["n0", "n1"]


def test_live_hosts_counts_beats_not_clocks():
    from wanka.control.store import AgentBeat

    reads = iter([{"a": AgentBeat("a", 1, 0, 0.1), "b": AgentBeat("b", 5, 0, 0.1)},
                  {"a": AgentBeat("a", 2, -9e9, 0.1), "b": AgentBeat("b", 5, 9e9, 0.1)}] * 50)  # fmt: skip
    live = live_hosts(lambda: next(reads), ["a", "b", "me"], {"me"}, 0.3, 0.01)
    assert live == {"a", "me"}  # b's clock says "now", but its counter never moved
    # A host just named lost is not waited for: returns at once when the others have moved.
    reads = iter([{"a": AgentBeat("a", 1, 0, 0.1)}, {"a": AgentBeat("a", 2, 0, 0.1)}])
    assert live_hosts(lambda: next(reads), ["a", "b"], set(), 30.0, 0.0, {"b"}) == {"a"}


@pytest.fixture
def trio(tmp_path, monkeypatch):
    """A job of 3 hosts x 1 rank with one hot spare: the coordinator n0, followers n1, n2."""
    port = _free_port()
    monkeypatch.setattr(hc, "local_hb_root", lambda: tmp_path / "shm")
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 2.0)
    evicted: dict = {}
    hosts = []
    for i, node in enumerate(["n0", "n1", "n2"]):
        monkeypatch.setenv("SLURM_NODEID", str(i))
        c = hc.HostControl(fake_sup(tmp_path, node, port, nnodes=3, spares=1, evicted=evicted))
        c.killed = []
        c._kill_local = lambda _pgid, sig, c=c: c.killed.append(sig)
        hosts.append(c)
    yield (*hosts, evicted)
    for c in hosts:
        c.orphaned = True


def _in_thread(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn()), daemon=True)
    t.start()
    return t, box


def test_a_spare_stands_by_then_replaces_a_lost_host(trio):
    head, n1, n2, _ = trio
    assert head.width == 2
    # The followers wait for the first attempt (beating); the coordinator plans it.
    j1, got1 = _in_thread(n1.join)
    j2, got2 = _in_thread(n2.join)
    head.begin(1)
    j1.join(10)
    j2.join(10)
    assert head.plans[1] == ["n0", "n1"] and got1["v"] == (1, None) and got2["v"] == (1, None)
    assert not n1.sits_out(1) and n2.sits_out(1)
    assert head.rdzv(1)["nnodes"] == "2" and head.world == 2
    n1.begin(1)
    assert n1.world == 2

    # n1's host goes (it beats no more); n2, the spare, waits for the next word, beating.
    # n0's memory holds rank 0's snapshots and n1's rank's copy: published after the attempt.
    _commit(head.snap_dir, "rank0", 5, 0, "w2-x")
    _commit(head.snap_dir, "replica-rank1", 5, 0, "w2-x")
    head.conclude(1, SimpleNamespace(cause="success"))  # publishes only after a fault ...
    assert head.root.get("snapshots/n0") is None
    head.publish_snapshots()  # ... as conclude() does then
    w2, nxt2 = _in_thread(lambda: n2.wait_next(1))
    assert head.plan(2, "node_lost", "n1") == ["n0", "n2"]
    assert head.gone == {"n1"} and head.snapshot_step[2] == 5
    head.announce(1, "restart", message="node n1: node_lost")
    w2.join(10)
    assert nxt2["v"]["action"] == "restart" and not n2.sits_out(2)
    assert nxt2["v"]["snapshot_step"] == 5
    assert n2.rdzv(2)["nnodes"] == "2" and n2.rdzv(2)["rdzv_id"] == "77.0.a2"


def test_an_evicted_host_stands_by_and_the_job_shrinks_without_a_spare(trio):
    head, n1, n2, evicted = trio
    head.plans[1] = ["n0", "n1"]  # n2 is the spare
    evicted["n2"] = "3 x hang"  # ... and the ledger evicts it: no spare left
    evicted["n1"] = "2 x process_crash"
    w1, nxt1 = _in_thread(lambda: n1.wait_next(1))
    w2, _ = _in_thread(lambda: n2.wait_next(1))
    assert head.plan(2, "process_crash", "n1") == ["n0"]
    assert head.others("n1") == ["n0"]  # what could train instead: n2 is evicted too
    head.announce(1, "restart", message="rank 1 on node n1: process_crash")
    w1.join(10)
    assert nxt1["v"]["evicted"] == ["n1", "n2"]
    assert n1.sits_out(2) and n1.evicted_now == {"n1", "n2"}
    assert n1.nnodes(2) == 1
    w2.join(10)


def test_too_few_hosts_for_the_first_attempt_is_one_line(trio, monkeypatch):
    head, *_ = trio
    monkeypatch.setattr(hc, "FIRST_PLAN_S", 0.5)
    with pytest.raises(ValueError, match=r"only 1 of the 2 hosts this job trains on reached"):
        head.plan(1)  # nobody else beats


def _commit(d, owner_dir: str, step: int, slot: int, sig: str, whole: bool = True) -> None:
    import pickle

    from wanka.resilience.snapshot import _meta_name

    f = d / owner_dir
    f.mkdir(parents=True, exist_ok=True)
    (f / _meta_name(step, slot, sig)).write_bytes(pickle.dumps({"size": 8}))
    (f / f"slot{slot}.{sig}.bin").write_bytes(b"x" * (8 if whole else 3))


def test_snapshot_inventory_and_the_step_every_rank_can_resume_from(tmp_path):
    """What each host's memory holds, by name, and the newest step every rank of the next
    world can get somewhere among the next attempt's hosts (SnapshotStore.restore's rule)."""
    from wanka.resilience.snapshot import inventory, restorable

    n0, n1, n2 = tmp_path / "n0", tmp_path / "n1", tmp_path / "n2"
    _commit(n0, "rank0", 10, 0, "w2-abc")
    _commit(n0, "rank0", 12, 1, "w2-abc")
    _commit(n0, "replica-rank1", 10, 0, "w2-abc")
    _commit(n0, "replica-rank1", 12, 1, "w2-abc", whole=False)  # its copy was cut short
    _commit(n1, "rank1", 12, 1, "w2-abc")
    _commit(n1, "rank1", 10, 0, "w2-abc")
    _commit(n2, "rank0", 4, 0, "w3-abc")  # another world size: not for a 2-rank job
    assert inventory(n0) == {"w2-abc": {0: [10, 12], 1: [10]}}
    assert inventory(tmp_path / "missing") == {}
    inv = {n.name: inventory(n) for n in (n0, n1, n2)}
    # n1 lost: rank 1 only as n0's replica, whole at step 10 only.
    assert restorable([inv["n0"], inv["n2"]], 2) == 10
    assert restorable([inv["n0"], inv["n1"]], 2) == 12
    assert restorable([inv["n2"]], 2) is None and restorable([inv["n2"]], 3) is None
    # Through the store (JSON): owners come back as strings.
    import json

    assert (
        restorable([json.loads(json.dumps(inv["n0"])), json.loads(json.dumps(inv["n1"]))], 2) == 12
    )


def test_a_planned_host_that_never_joins_the_attempt_is_lost(trio):
    """n1 was planned for attempt 1 but went before it began: the coordinator names it lost
    from the store within the agents' limit, not after torchrun's rendezvous time-out."""
    head, n1, n2, _ = trio
    head.plans[1] = ["n0", "n1"]
    head.begin(1)
    assert head.coordinator.check(time.time() + 1.0) is None  # within the limit (2 s here)
    fault = head.coordinator.check(time.time() + 3.0)
    assert (fault.cause, fault.node) == ("node_lost", "n1") and "never joined" in fault.detail
    # Once it has joined, nothing is said of it.
    n1.plans[1] = ["n0", "n1"]
    n1.begin(1)
    assert head.coordinator._never_joined(time.time() + 3.0) is None
