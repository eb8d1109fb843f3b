"""resilience/host_control.py: one supervisor per host (Slurm, Kubernetes) coordinated through
the control store. The whole path runs under the stand-in srun in tests/cluster/
test_launch_srun.py; here the parts, against a real TCPStore in this process."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from wanka.resilience import host_control as hc
from wanka.resilience.monitor import StopRequested, Timeouts
from wanka.resilience.supervisor import Outcome


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_sup(tmp: Path, node: str, port: int, nnodes: int = 2, rdzv_id: str = "77.0",
             spares: int = 0, evicted: dict | None = None):  # fmt: skip
    rdzv = {"rdzv_endpoint": f"127.0.0.1:{port - 1}", "rdzv_id": rdzv_id, "nnodes": nnodes}
    chaos = SimpleNamespace(inside_ids=lambda: [], note_fired=lambda marks: None)
    evicted = {} if evicted is None else evicted  # the ledger's evictions, shared by reference
    return SimpleNamespace(rdzv=rdzv, nproc=1, nnodes=nnodes, node=node, chaos=chaos,
                           stop_requested=threading.Event(),
                           rc=SimpleNamespace(spare_nodes=spares, snapshot_dir=str(tmp / "snap")),
                           job="job", run_dir=tmp / "run",
                           ledger=SimpleNamespace(evicted=lambda: dict(evicted)),
                           timeouts=Timeouts(tmp / f"{node}-timeouts.json", 3.0, 1.0, 30.0))  # fmt: skip


def stop_serving(head) -> None:
    """The coordinator's store goes away (as with its host): every reference to it dropped."""
    import gc

    views = [head.server, head.root, head.view]
    views += [head.agent.store] if head.agent else []
    views += [head.coordinator.store] if head.coordinator else []
    for v in views:
        if v is not None:
            v.store = None
    gc.collect()


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """The coordinator's and a follower's HostControl for one job (2 hosts x 1 rank)."""
    port = _free_port()
    monkeypatch.setattr(hc, "local_hb_root", lambda: tmp_path / "shm")
    monkeypatch.setenv("SLURM_NODEID", "0")
    head = hc.HostControl(fake_sup(tmp_path, "n0", port))
    monkeypatch.setenv("SLURM_NODEID", "1")
    follower = hc.HostControl(fake_sup(tmp_path, "n1", port))
    # A stop here must never reach the test process's own children (other tests' jobs): each
    # host records what it would kill; only the test of _kill_local itself calls the real one.
    for c in (head, follower):
        c.killed = []
        c._kill_local = lambda _pgid, sig, c=c: c.killed.append(sig)
    yield head, follower
    for c in (head, follower):  # ends any watch loop a failed test left running
        c.orphaned = True


def test_address_role_and_one_line_errors(monkeypatch):
    assert hc.control_address({"rdzv_endpoint": "gpu-a01:29500"}) == ("gpu-a01", 29501)
    monkeypatch.setenv(hc.CONTROL_PORT_ENV, "31000")
    assert hc.control_address({"rdzv_endpoint": "[fe80::1]:29500"}) == ("fe80::1", 31000)
    monkeypatch.setenv(hc.CONTROL_PORT_ENV, "31k")
    with pytest.raises(ValueError, match="WANKA_CONTROL_PORT='31k'"):
        hc.control_address({"rdzv_endpoint": "h:1"})
    with pytest.raises(ValueError, match="needs --rdzv-endpoint HOST:PORT"):
        hc.control_address({"rdzv_endpoint": None})
    # An etcd rendezvous names the etcd server: the control store's host must be given.
    etcd = {"rdzv_backend": "etcd-v2", "rdzv_endpoint": "etcd.svc:2379"}
    monkeypatch.delenv(hc.CONTROL_PORT_ENV)
    with pytest.raises(ValueError, match="set WANKA_CONTROL_ENDPOINT=HOST:PORT"):
        hc.control_address(etcd)
    monkeypatch.setenv(hc.CONTROL_ENDPOINT_ENV, "trainer-0:29600")
    assert hc.control_address(etcd) == ("trainer-0", 29600)
    monkeypatch.setenv(hc.CONTROL_ENDPOINT_ENV, "trainer-0")
    with pytest.raises(ValueError, match="needs WANKA_CONTROL_ENDPOINT HOST:PORT"):
        hc.control_address(etcd)
    monkeypatch.delenv(hc.CONTROL_ENDPOINT_ENV)
    monkeypatch.setenv("SLURM_NODEID", "3")
    assert not hc.is_coordinator(socket.gethostname())
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert hc.is_coordinator("some-other-host")
    monkeypatch.delenv("SLURM_NODEID")
    assert hc.is_coordinator(socket.gethostname())  # torch's rule: the endpoint names us
    assert not hc.is_coordinator("host-that-is-not-this-one.invalid")


def test_no_rendezvous_id_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_NODEID", "0")
    with pytest.raises(ValueError, match="needs --rdzv-id"):
        hc.HostControl(fake_sup(tmp_path, "n0", _free_port(), rdzv_id="none"))


def test_each_attempt_meets_at_a_rendezvous_of_its_own(pair):
    head, follower = pair
    assert head.coordinating and not follower.coordinating
    assert head.rdzv(1)["rdzv_id"] == follower.rdzv(1)["rdzv_id"] == "77.0.a1"
    assert head.rdzv(2)["rdzv_id"] == "77.0.a2"
    assert head.hb_dir(1) != follower.hb_dir(1)  # each host's own folder


def test_a_remote_host_gone_is_named_not_the_coordinators_own_reset_ranks(pair, monkeypatch):
    """The coordinator's ranks died of connection resets because the follower's host went
    (its agent beats no more). The coordinator's attempt ended first, but conclude() keeps
    looking at the store until the follower's silence passes the limit: node_lost on n1, not
    the coordinator's own process_crash."""
    head, follower = pair
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 1.0)
    for c in (head, follower):
        c.begin(1)
    follower.agent.poll_once()  # it beat, then its host went
    out = Outcome("process_crash", rank=0, node="n0", t_fault=time.time(), t_detect=time.time(),
                  detail="rank 0 died in forward of step 4, exit 1: Connection reset by peer")  # fmt: skip
    out.error = "RuntimeError: Connection reset by peer"
    t0 = time.monotonic()
    head.conclude(1, out)
    assert (out.cause, out.node) == ("node_lost", "n1"), out
    assert out.error is None and time.monotonic() - t0 < 3.0
    assert head.view.get("verdict")["node"] == "n1"


def test_a_fault_seen_first_by_the_coordinator_stops_the_followers(pair, monkeypatch):
    """The coordinator's own rank died: its agent ended the attempt before the store named
    anything. conclude() writes the verdict and the stop; the follower's agent carries it out
    (kills its ranks), its watch reports the same fault, and it waits for what follows."""
    head, follower = pair
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 1.0)  # conclude() looks this long for more
    killed = []
    monkeypatch.setattr(follower, "_kill_local", lambda _pgid, sig: killed.append(sig))
    for c in (head, follower):
        c.begin(1)
    follower.agent.kill = follower._kill_local
    out = Outcome("process_crash", rank=0, detail="rank 0 died in forward of step 4",
                  t_fault=time.time(), t_detect=time.time(), node="n0")  # fmt: skip
    seen = Outcome("success")
    stop = threading.Event()
    t = threading.Thread(target=follower.watch, args=(None, 1, seen, stop))
    t.start()  # the follower's host is up: its agent beats
    head.conclude(1, out)
    deadline = time.monotonic() + 10
    while (not killed or seen.cause == "success") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert killed, "the follower's ranks were not stopped"
    assert (seen.cause, seen.rank, seen.node) == ("process_crash", 0, "n0")
    # It keeps stopping ranks (one a late rendezvous starts) until the attempt has ended.
    n = len(killed)
    time.sleep(0.5)
    assert t.is_alive() and len(killed) > n
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive()
    # What follows: the follower waits (publishing) until the coordinator says.
    got = {}
    w = threading.Thread(target=lambda: got.update(follower.wait_next(1)))
    w.start()
    time.sleep(0.3)
    assert w.is_alive() and not got
    head.announce(1, "restart")
    w.join(timeout=5)
    assert got["action"] == "restart"
    head.begin(2)
    follower.begin(2)
    head.announce(2, "end", 2, "user_error: bad config")
    nxt = follower.wait_next(2)
    assert (nxt["action"], nxt["rc"], nxt["message"]) == ("end", 2, "user_error: bad config")


def test_a_follower_that_loses_the_store_while_training_stops_its_ranks(pair, monkeypatch):
    """The coordinator's host went: nobody is left to decide, the follower's ranks must not
    train on (or wait on gloo) for ever."""
    head, follower = pair
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 1.0)
    killed = []
    follower.begin(1)
    follower.agent.kill = lambda _pgid, sig: killed.append(sig)
    monkeypatch.setattr(follower, "_kill_local", lambda _pgid, sig: killed.append(sig))
    out, stop = Outcome("success"), threading.Event()
    t = threading.Thread(target=follower.watch, args=(None, 1, out, stop))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and out.cause == "success"  # the store answers: nothing to do
    stop_serving(head)
    t.join(timeout=30)
    assert not t.is_alive() and killed
    assert (out.cause, out.rank, out.node) == ("node_lost", None, "127.0.0.1")
    assert "unreachable" in out.detail
    assert follower.wait_next(1)["rc"] == 1  # at once: no second wait for the same store


def test_a_follower_whose_coordinator_is_gone_ends_the_job(pair, monkeypatch):
    head, follower = pair
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 1.0)
    follower.begin(1)
    stop_serving(head)  # the follower's client now fails
    t0 = time.monotonic()
    nxt = follower.wait_next(1)
    assert nxt["action"] == "end" and nxt["rc"] == 1
    assert "node 127.0.0.1: node_lost (the control store at 127.0.0.1:" in nxt["message"]
    assert time.monotonic() - t0 < 30


def test_chaos_marks_travel_through_the_store_not_the_run_directory(tmp_path):
    """A drill's inside fault (slow, nan) fires in a rank, which marks its node's own folder;
    the node's agent publishes the mark; the supervisor records it (no replay in the next
    attempt; the drill reads when it fired from the run directory the supervisor writes)."""
    from wanka.control.agent import NodeAgent
    from wanka.control.store import ControlStore
    from wanka.resilience.chaos import ChaosDriver, WorkerChaos, parse_schedule

    server = ControlStore.serve("127.0.0.1", 0, "j")
    view = ControlStore(server.store, server.host, server.port, "j/a1")
    hb = tmp_path / "node-local" / "attempt1"
    faults = parse_schedule("slow@step=4,rank=1,ms=10,steps=1;kill@step=9,rank=0")
    driver = ChaosDriver(faults, tmp_path / "run", "j", str(tmp_path / "shm"), timeline=None)
    spec = driver.worker_spec()
    assert "slow@step=4" in spec and driver.inside_ids() == [faults[0].id]
    rank = WorkerChaos(spec, 1, hb / "chaos")  # as worker.py builds it from WANKA_CHAOS_MARKS
    assert rank.delay(3) > 0  # the 4th step (0-based 3) fires it: marks the node's folder
    agent = NodeAgent(view, "n1", hb, attempt=1)
    agent.poll_once()
    ((fid, (t, node)),) = view.read_chaos(driver.inside_ids()).items()
    assert fid == faults[0].id and node == "n1"
    assert t == (hb / "chaos" / f"{fid}.fired").stat().st_mtime
    driver.note_fired(view.read_chaos(driver.inside_ids()))
    mark = tmp_path / "run" / "resilience" / "chaos" / f"{fid}.fired"
    assert mark.stat().st_mtime == t  # written by the supervisor, dated when it fired
    assert "slow" not in driver.worker_spec()  # not replayed by the next attempt
    assert driver.injected_inside("slow", 1)
    agent.poll_once()  # published once
    assert agent._marks_sent == {fid}


def test_a_verdict_alone_stops_the_followers_ranks(pair, monkeypatch):
    """Whatever order the follower reads the stop and the verdict in, a verdict ends its
    attempt: it kills its ranks itself (a race found in review: the decision read just before
    it was written, the verdict just after, and nothing stopped the ranks)."""
    head, follower = pair
    for c in (head, follower):
        c.begin(1)
    killed = []
    monkeypatch.setattr(follower, "_kill_local", lambda _pgid, sig: killed.append(sig))
    out = Outcome("process_crash", rank=0, detail="d", t_fault=1.0, t_detect=2.0, node="n0")
    head.view.put("verdict", hc._verdict(out))  # no decision written at all
    seen, stop = Outcome("success"), threading.Event()
    threading.Timer(1.0, stop.set).start()  # the attempt ends (its ranks were killed)
    follower.watch(None, 1, seen, stop)
    assert killed and seen.cause == "process_crash"


def test_an_agent_still_waiting_after_the_verdict_is_stopped(pair, monkeypatch):
    """Ranks that exited 0 mid-job (os._exit(0) in a user's reward) leave torch's agent waiting
    for their return values: nothing would set `stop`. The watch asks the supervisor to stop
    its launcher, once, UNSTICK_AFTER_S after the verdict (it used to loop for ever)."""
    head, follower = pair
    for c in (head, follower):
        c.begin(1)
    monkeypatch.setattr(hc, "UNSTICK_AFTER_S", 0.3)
    stop, asked = threading.Event(), []

    def stop_stuck_launcher():
        asked.append(time.monotonic())
        threading.Timer(0.5, stop.set).start()  # the agent ends on the signal

    follower.sup.stop_stuck_launcher = stop_stuck_launcher
    out = Outcome("process_crash", rank=0, detail="d", t_fault=1.0, t_detect=2.0, node="n0")
    head.view.put("verdict", hc._verdict(out))
    seen, t0 = Outcome("success"), time.monotonic()
    threading.Timer(20.0, stop.set).start()  # a bound on the test, never reached when fixed
    follower.watch(None, 1, seen, stop)
    assert len(asked) == 1 and asked[0] - t0 < 5.0 and seen.cause == "process_crash"


def test_a_frozen_coordinator_is_noticed_within_the_limit(tmp_path, monkeypatch):
    """A SIGSTOPped store host: store calls block far past their own time-out (they wait for
    TCP). The follower still fences within the limit, and waits for no answer afterwards."""
    import signal
    import subprocess
    import sys

    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 1.5)
    monkeypatch.setattr(hc, "local_hb_root", lambda: tmp_path / "shm")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-c", f"""
import time, datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", {port}, None, True, datetime.timedelta(seconds=30),
                  wait_for_workers=False)
s.set("wanka/serving", "77.0")  # as ControlStore.serve marks it: job 77.0's coordinator's
print("up", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout.readline().strip() == "up"
        monkeypatch.setenv("SLURM_NODEID", "1")
        follower = hc.HostControl(fake_sup(tmp_path, "n1", port))
        follower.begin(1)
        killed = []
        follower.agent.kill = lambda _pgid, sig: killed.append(sig)
        monkeypatch.setattr(follower, "_kill_local", lambda _pgid, sig: killed.append(sig))
        server.send_signal(signal.SIGSTOP)
        out = Outcome("success")
        t0 = time.monotonic()
        follower.watch(None, 1, out, threading.Event())
        took = time.monotonic() - t0
        assert out.cause == "node_lost" and killed and took < 1.5 + 2.0, (out, took)
        t0 = time.monotonic()
        assert follower.wait_next(1)["rc"] == 1 and time.monotonic() - t0 < 0.5
    finally:
        server.kill()
        server.wait()


def test_a_host_restarted_mid_job_joins_the_next_attempt(pair):
    """A follower (re)started while attempt 3 trains without it (its pod replaced): it must not
    join attempt 1's rendezvous nor act on old stops; it waits for attempt 3's end."""
    head, follower = pair
    head.begin(3)
    head.root.put("current", {"attempt": 3, "formed": True})
    got = {}
    t = threading.Thread(target=lambda: got.update(zip(("first", "ended"), follower.join())))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting for attempt 3's end
    head.announce(3, "restart", message="rank 1 on node n1: process_crash (...)")
    t.join(timeout=5)
    assert got == {"first": 4, "ended": None}
    # An attempt still forming is joined as it is.
    head.root.put("current", {"attempt": 4, "formed": False})
    assert follower.join() == (4, None)


def test_a_follower_waits_for_the_first_attempt_or_the_jobs_end(pair):
    """The coordinator's pre-flight failed before any attempt: the follower ends with it, it
    does not start an attempt nobody hosts."""
    head, follower = pair
    got = {}
    t = threading.Thread(target=lambda: got.update(zip(("first", "ended"), follower.join())))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    head.announce(1, "end", 2, "pre-flight failed")
    t.join(timeout=5)
    assert got["first"] == 0 and got["ended"]["rc"] == 2


def test_a_stop_kills_only_the_attempts_own_children(pair):
    import subprocess
    import sys

    head, _ = pair
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        head.begin(1)
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        hc.HostControl._kill_local(head, 0, 9)
        assert rank.wait(timeout=5) == -9
        assert before.poll() is None  # there before the attempt: not one of its ranks
    finally:
        before.kill()
        before.wait()


def test_a_slow_call_after_a_quiet_spell_is_not_taken_for_a_lost_store(pair, monkeypatch):
    """The deadline runs from the call's start when the last answer is old (a follower's first
    call after a long start-up): a healthy but slow call is waited for."""
    _, follower = pair
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 1.0)
    follower._last_ok = time.monotonic() - 20
    assert follower._answered(lambda: (time.sleep(0.3), "ok")[1]) == "ok"


def test_an_attempt_that_ended_before_forming_is_not_joined(pair):
    """Attempt 3 failed while still starting (a host died in its start-up): a host restarting
    now must wait for what follows it, not join its rendezvous."""
    head, follower = pair
    head.begin(3)
    out = Outcome("node_lost", node="n1", detail="agent silent", t_fault=1.0, t_detect=2.0)
    head._stop_all(3, out, "node n1: node_lost")
    assert head.root.get("current") == {
        "attempt": 3,
        "formed": False,
        "over": True,
        "members": None,
    }
    head.announce(3, "restart", message="node n1: node_lost (agent silent)")
    assert follower.join() == (4, None)


def test_a_stop_request_while_waiting_for_the_coordinator_is_resumable(pair):
    _, follower = pair
    stop = threading.Event()
    stop.set()
    nxt = follower.wait_next(1, stop)
    assert (nxt["action"], nxt["rc"]) == ("end", 75)


def test_a_stop_request_while_waiting_for_hosts_ends_the_wait(tmp_path, monkeypatch):
    """SIGTERM while the coordinator waits for hosts to reach the store (up to FIRST_PLAN_S)
    or a follower waits for the first attempt was only noted: the host waited on, holding
    its allocation. Now the wait ends at once (the supervisor exits resumable, 75)."""
    port = _free_port()
    monkeypatch.setattr(hc, "local_hb_root", lambda: tmp_path / "shm")
    monkeypatch.setenv("SLURM_NODEID", "0")
    head = hc.HostControl(fake_sup(tmp_path, "n0", port, nnodes=3))
    monkeypatch.setenv("SLURM_NODEID", "1")
    follower = hc.HostControl(fake_sup(tmp_path, "n1", port, nnodes=3))
    try:
        for c, waits, why in ((head, lambda: head.plan(1), "of 3 reached"),
                              (follower, follower.join, "coordinator's first attempt")):  # fmt: skip
            threading.Timer(0.5, c.sup.stop_requested.set).start()
            t0 = time.monotonic()
            with pytest.raises(StopRequested, match=why):
                waits()
            assert time.monotonic() - t0 < 5
    finally:
        for c in (head, follower):
            c.orphaned = True


def test_a_follower_whose_pre_flight_failed_ends_the_job_at_the_coordinator(pair):
    """The coordinator's attempt waits at the rendezvous for every host: a follower that ends
    before its first attempt says so, and the coordinator names it and stops the attempt."""
    head, follower = pair
    head.begin(1)
    follower.leave(2, "its pre-flight failed (see that node's output)")
    out = Outcome("success")
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    head.watch(None, 1, out, stop)
    assert (out.cause, out.node) == ("user_error", "n1")
    assert out.said == "node n1: its pre-flight failed (see that node's output)"
    assert head.view.get("verdict")["cause"] == "user_error"
    assert head.view.read_decision()["action"] == "stop"


def test_a_hang_stop_writes_the_stacks_of_each_hosts_ranks_first(pair, tmp_path):
    """After a hang the coordinator's stop asks for stacks: every host's agent writes its own
    ranks' (logs/stacks-attemptN-NODE.txt, Python stacks in the rank logs) before killing
    them; a crash's stop does not."""
    import subprocess
    import sys

    head, follower = pair
    for c in (head, follower):
        c.begin(1)
    code = ("import sys, time; from pathlib import Path; "
            "from wanka.resilience.heartbeat import Reporter; "
            "r = Reporter(Path(sys.argv[1]), 1, 1); r.enter('forward', 3); time.sleep(60)")  # fmt: skip
    rank = subprocess.Popen([sys.executable, "-c", code, str(follower.hb_dir(1))])
    try:
        deadline = time.monotonic() + 30
        while not (follower.hb_dir(1) / "rank1.hb").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        follower.agent.poll_once()
        out = Outcome("hang", rank=1, node="n1", detail="rank 1 stuck in forward of step 4",
                      t_fault=time.time(), t_detect=time.time())  # fmt: skip
        head._stop_all(1, out, "rank 1 on node n1: hang (stuck in forward)")
        assert head.view.read_decision()["dump"] is True
        follower.agent.poll_once()  # carries the stop out: stacks first, then the kill
        stacks = tmp_path / "run" / "logs" / "stacks-attempt1-n1.txt"
        assert f"rank 1 pid {rank.pid} step 3 phase forward" in stacks.read_text()
        assert rank.wait(timeout=10) != 0
    finally:
        rank.kill()
        rank.wait()
    crash = Outcome("process_crash", rank=0, node="n0", detail="rank 0 died",
                    t_fault=time.time(), t_detect=time.time())  # fmt: skip
    head._stop_all(1, crash, "rank 0 on node n0: process_crash")
    assert head.view.read_decision()["dump"] is False


@pytest.mark.parametrize("error, code, named", [
    # Ours died first-hand (killed from outside; its own exception, even one naming NCCL or a
    # read error): the remote death that follows is its consequence.
    (None, -9, ("process_crash", 1, "n0")),
    ("ValueError: bad batch", 1, ("process_crash", 1, "n0")),
    ("DistBackendError: NCCL error: ncclUnhandledCudaError: illegal memory access", 1,
     ("process_crash", 1, "n0")),
    ("OSError: [Errno 5] read error on /data/shard3", 1, ("process_crash", 1, "n0")),
    # Ours was a victim (a lost peer's words), or we cannot tell (SIGABRT: NCCL's watchdog).
    ("RuntimeError: [gloo] Read error: Connection reset by peer", 1, ("process_crash", 0, "n1")),
    (None, -6, ("process_crash", 0, "n1")),
])  # fmt: skip
def test_a_remote_crash_is_named_instead_of_ours_only_when_ours_was_its_victim(
    pair, monkeypatch, error, code, named
):
    head, follower = pair
    monkeypatch.setattr(hc, "AGENT_TIMEOUT_S", 2.0)
    for c in (head, follower):
        c.begin(1)
    stop = threading.Event()
    seen = Outcome("success")
    t = threading.Thread(target=follower.watch, args=(None, 1, seen, stop))
    t.start()  # the follower's host is up and beats
    try:
        follower.view.report_exit(0, 1, "RuntimeError: boom", "n1", 1)  # a rank of n1 died
        out = Outcome("process_crash", rank=1, node="n0", detail="rank 1 died in forward",
                      t_fault=time.time(), t_detect=time.time())  # fmt: skip
        out.error, out.exits = error, {1: code}
        t0 = time.monotonic()
        head.conclude(1, out)
        # Decided on the store's naming (seen within a poll or two), not after its whole wait.
        assert time.monotonic() - t0 < 1.5
        assert (out.cause, out.rank, out.node) == named
        assert (head.view.get("verdict")["rank"], head.view.get("verdict")["node"]) == named[1:]
    finally:
        stop.set()
        t.join(timeout=5)


def test_a_stack_dump_cut_short_keeps_what_it_took(tmp_path, monkeypatch):
    """Written rank by rank; once the ranks are being killed (cancel), no further rank's pid
    is signalled (it may already be another process's)."""
    from wanka.resilience import monitor
    from wanka.resilience.heartbeat import Beat

    cancel = threading.Event()

    def state(pid):  # the kill starts while the first rank is being looked at
        cancel.set()
        return "T"  # stopped: no signal sent

    monkeypatch.setattr(monitor, "process_state", state)
    beats = {r: Beat(rank=r, pid=2**22 + r, attempt=1, step=5, phase="forward", since=0.0,
                     written=0.0, max_seconds={}) for r in (0, 1)}  # fmt: skip
    out = tmp_path / "stacks.txt"
    monitor.dump_stacks(beats, out, wait_s=0.0, cancel=cancel)
    text = out.read_text()
    assert "rank 0 pid 4194304 step 5 phase forward state T" in text
    assert "rank 1 pid" not in text and "cut short" in text
