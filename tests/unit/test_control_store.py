"""The control plane's logic on a real TCPStore served in this process: the store's key layout
and errors, one node agent polled by hand, and the coordinator's rules on published records."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from wanka.control import coordinator as coord
from wanka.control.agent import NodeAgent
from wanka.control.coordinator import Coordinator
from wanka.control.store import OWNER_KEY, ControlStore, unpack_record
from wanka.resilience import heartbeat, supervisor
from wanka.resilience.heartbeat import PHASES, Reporter, read_beat
from wanka.resilience.monitor import Timeouts

# Generous: on some sandboxes one TCPStore connection in a few dozen takes 5 s to be accepted.
CONNECT_S = 20


@pytest.fixture
def server():
    return ControlStore.serve("127.0.0.1", 0, "job1", timeout_s=CONNECT_S)


def client(server: ControlStore, job: str = "job1") -> ControlStore:
    return ControlStore.connect("127.0.0.1", server.port, job, timeout_s=CONNECT_S)


def record(step: int, phase: str, since: float, pid: int = 4242, attempt: int = 1,
           done: dict[str, float] | None = None) -> bytes:  # fmt: skip
    """A heartbeat record as Reporter packs it; `done`: the phases' recent longest durations."""
    mx = [(done or {}).get(p, 0.0) for p in PHASES]
    return struct.pack(heartbeat._FMT, heartbeat._MAGIC, pid, attempt, step,
                       heartbeat.PHASE_ID[phase], since, since, *mx)  # fmt: skip


# -- the store -------------------------------------------------------------------------------
def test_a_record_read_from_the_store_is_the_one_the_file_holds(tmp_path, server):
    rep = Reporter(tmp_path, rank=3, attempt=2)
    rep.enter("forward", step=7)
    raw = (tmp_path / "rank3.hb").read_bytes()
    assert unpack_record(raw, 3) == read_beat(tmp_path / "rank3.hb")
    assert unpack_record(raw[:-1], 3) is None  # torn
    assert unpack_record(b"XXXX" + raw[4:], 3) is None

    client(server).publish_rank(3, raw, "n1", "S")
    got = server.read_ranks(world_size=8)
    assert list(got) == [3]
    assert got[3].beat == read_beat(tmp_path / "rank3.hb")
    assert (got[3].node, got[3].state) == ("n1", "S")


def test_every_key_lives_under_its_job_and_jobs_do_not_mix(server):
    other = client(server, job="job2")
    a = client(server)
    a.register_node("n1")
    a.beat_agent("n1", 0.1)
    a.publish_rank(0, record(1, "data", time.time()), "n1", "R")
    a.report_exit(0, 1, "boom", "n1", 1)
    a.write_decision("stop", 1, "test")
    keys = set(server.store.list_keys()) - {OWNER_KEY}  # whose store it is: the one other key
    assert all(k.startswith("wanka/job1/") for k in keys)
    assert other.read_ranks(4) == {} and other.read_exits(4) == {} and other.nodes() == []
    assert other.read_decision() is None


def test_agents_registering_at_once_are_all_kept(server):
    clients = [client(server) for _ in range(4)]
    start = threading.Barrier(len(clients))

    def register(i: int) -> None:
        start.wait()
        for j in range(5):
            clients[i].register_node(f"n{i}-{j}")

    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clients[0].register_node("n0-0")  # a restarted agent registers again
    assert server.nodes() == sorted(f"n{i}-{j}" for i in range(4) for j in range(5))


def test_agent_beats_count_up_and_decisions_carry_a_sequence(server):
    c = client(server)
    c.register_node("n1")
    assert [c.beat_agent("n1", 0.2) for _ in range(3)] == [1, 2, 3]
    beat = server.read_agents()["n1"]
    assert (beat.count, beat.poll_s) == (3, 0.2) and beat.t <= time.time()
    first = server.write_decision("stop", 1, "hang")
    second = server.write_decision("stop", 1, "hang")
    assert second["seq"] == first["seq"] + 1
    assert c.read_decision() == second


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_store_is_one_line_naming_host_and_port():
    port = _free_port()
    with pytest.raises(ConnectionError) as e:
        ControlStore.connect("127.0.0.1", port, "job1", timeout_s=1)
    assert f"127.0.0.1:{port}" in str(e.value) and "\n" not in str(e.value)
    assert "coordinator running" in str(e.value)


def test_a_port_in_use_is_one_line(server):
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{server.port}.*port in use"):
        ControlStore.serve("127.0.0.1", server.port, "job1")


def test_a_store_that_went_away_is_a_connection_error():
    srv = ControlStore.serve("127.0.0.1", 0, "job1", timeout_s=CONNECT_S)
    c = client(srv)
    del srv
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:\d+ failed to .*coordinator still"):
        for _ in range(20):  # a write may land in the socket's buffer; a read cannot
            c.nodes()
            time.sleep(0.05)


# -- the node agent, polled by hand -----------------------------------------------------------
def test_agent_publishes_its_ranks_their_state_exits_and_its_beat(tmp_path, server):
    rep = Reporter(tmp_path, rank=1, attempt=1)  # a rank that is this process: alive
    rep.enter("data", step=0)
    (tmp_path / "rank0.hb").write_bytes(record(0, "forward", time.time(), pid=2**22 + 12345))
    (tmp_path / "rank0.exit").write_text("2\nbad config: data.path missing")
    (tmp_path / "rank5.hb").write_bytes(b"torn")
    agent = NodeAgent(client(server), "n1", tmp_path, poll_s=0.1)
    assert agent.poll_once() is None
    ranks = server.read_ranks(8)
    assert sorted(ranks) == [0, 1]
    assert ranks[1].state in ("R", "S") and ranks[1].node == "n1"
    assert ranks[0].state == "gone"
    ex = server.read_exits(8)[0]
    assert (ex.code, ex.message, ex.node, ex.attempt) == (
        2,
        "bad config: data.path missing",
        "n1",
        1,
    )
    assert server.read_agents()["n1"].count == 1
    agent.poll_once()
    assert server.read_agents()["n1"].count == 2


def test_a_stop_kills_the_given_group_once(tmp_path, server):
    stale = server.write_decision("stop", 0, "an earlier attempt's")
    killed = []
    agent = NodeAgent(client(server), "n1", tmp_path, 0.1, pgid=777,
                      kill=lambda pg, sig: killed.append((pg, sig)))  # fmt: skip
    agent.poll_once()
    assert killed == []  # written before this agent started
    d = Coordinator(server, 4, Timeouts(tmp_path / "t.json", 3.0, 1.0, 5.0)).decide_stop(1, "hang")
    assert d["seq"] == stale["seq"] + 1
    assert agent.poll_once() == d
    agent.poll_once()
    assert killed == [(777, signal.SIGKILL)]
    done = server.read_done()["n1"]
    assert (done["seq"], done["detail"]) == (d["seq"], "killed process group 777")


def test_an_agent_whose_store_is_gone_fences_its_node_once_after_orphan_s(tmp_path):
    """The store's host (the coordinator's) died: after orphan_s without it the agent stops its
    node's ranks itself (nobody is left to decide), once; a store that is back in time is not
    a reason to."""
    srv = ControlStore.serve("127.0.0.1", 0, "job1", timeout_s=CONNECT_S)
    killed = []
    agent = NodeAgent(client(srv), "n1", tmp_path, 0.05, pgid=778, orphan_s=0.5,
                      kill=lambda pg, sig: killed.append((pg, sig)))  # fmt: skip
    stop = threading.Event()
    t = threading.Thread(target=agent.run_until, args=(stop,))
    t.start()
    time.sleep(0.8)
    assert killed == [] and not agent.fenced  # the store answers: nothing to do
    del srv  # the store's process is gone
    deadline = time.monotonic() + 10
    while not killed and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    stop.set()
    t.join()
    assert killed == [(778, signal.SIGKILL)] and agent.fenced


def test_an_agent_of_one_attempt_ignores_stops_for_another(tmp_path, server):
    killed = []
    agent = NodeAgent(client(server), "n1", tmp_path, 0.1, pgid=5, attempt=2,
                      kill=lambda pg, sig: killed.append(pg))  # fmt: skip
    server.write_decision("stop", 1, "late word about attempt 1")
    agent.poll_once()
    server.write_decision("stop", 2, "hang")
    agent.poll_once()
    assert killed == [5]


# -- the coordinator's rules -----------------------------------------------------------------
@pytest.fixture
def job(tmp_path, server):
    """Two nodes whose agents beat; ranks 0-1 on n1, 2-3 on n2, all in step 3 of attempt 1."""
    agents = {n: client(server) for n in ("n1", "n2")}
    for n, c in agents.items():
        c.register_node(n)
        c.beat_agent(n, 0.1)
    now = time.time()
    done = {"data": 0.05, "forward": 0.2, "backward": 0.3, "optimizer": 0.1}
    for r in range(4):
        node = "n1" if r < 2 else "n2"
        agents[node].publish_rank(r, record(3, "forward", now - 0.1, done=done), node, "S")
    timeouts = Timeouts(tmp_path / "t.json", factor=3.0, floor=1.0, initial=5.0)
    return Coordinator(server, 4, timeouts, agent_timeout_s=5.0, attempt=1), agents, now


def named(c, agents, now):
    """The verdict once every agent has beaten twice after the death was first seen."""
    assert c.check(now) is None  # first seen: held until every node has beaten since
    for _ in range(2):
        for n, a in agents.items():
            a.beat_agent(n, 0.1)
    return c.check(now)


def test_a_healthy_job_has_no_fault(job):
    c, _, now = job
    assert c.check(now) is None


def test_a_gone_rank_is_a_crash_on_its_node(job):
    c, agents, now = job
    agents["n2"].publish_rank(3, record(3, "backward", now - 0.1), "n2", "gone")
    f = named(c, agents, now)
    assert (f.cause, f.rank, f.node) == ("process_crash", 3, "n2")
    assert f.describe() == (
        "rank 3 on node n2: process_crash (rank 3 died in backward of step 4, process gone)"
    )


def test_the_killed_rank_is_blamed_not_the_ones_that_exited_of_it(job):
    c, agents, now = job
    agents["n1"].publish_rank(0, record(3, "sync", now), "n1", "gone")
    agents["n1"].report_exit(0, 1, "", "n1", 1)  # lost its peer in a collective
    agents["n2"].publish_rank(2, record(3, "sync", now), "n2", "Z")
    f = named(c, agents, now)
    assert (f.cause, f.rank, f.node, f.state) == ("process_crash", 2, "n2", "Z")


def test_a_death_or_hang_in_the_jobs_own_code_is_user_code_not_the_nodes(job):
    """A rank gone (os._exit(0) in a post.reward function) or stuck while in the user_code
    phase: cause user_code, which the ledger does not count against the node."""
    c, agents, now = job
    agents["n2"].publish_rank(2, record(3, "user_code", now - 0.1), "n2", "gone")
    f = named(c, agents, now)
    assert (f.cause, f.rank, f.node) == ("user_code", 2, "n2")
    assert "died in the job's own code (post.reward) of step 4" in f.detail
    agents["n2"].publish_rank(2, record(3, "user_code", now - 60.0), "n2", "S")
    f = c.check(now)
    assert (f.cause, f.rank) == ("user_code", 2) and "no progress" in f.detail


def test_an_exit_code_2_is_a_user_error_with_its_words(job):
    c, agents, now = job
    agents["n1"].publish_rank(1, record(-1, "init", now), "n1", "gone")
    agents["n1"].report_exit(1, supervisor.EXIT_USER_ERROR, "data.path: no such file", "n1", 1)
    f = named(c, agents, now)
    assert (f.cause, f.rank, f.node) == ("user_error", 1, "n1")
    assert "data.path: no such file" in f.detail


def test_a_death_before_the_first_step_is_a_startup_failure(job):
    c, agents, now = job
    agents["n1"].publish_rank(0, record(-1, "init", now), "n1", "gone")
    assert named(c, agents, now).cause == "startup_failure"


def test_a_death_while_another_node_goes_silent_is_that_node_lost(job):
    # n2 went down: its agent stops, and rank 0 on n1 dies at once of the reset connection.
    c, agents, now = job
    agents["n1"].publish_rank(0, record(3, "sync", now), "n1", "gone")
    agents["n1"].report_exit(0, 1, "Connection reset by peer", "n1", 1)
    for t in (0.0, 0.3, 0.6):
        agents["n1"].beat_agent("n1", 0.1)
        assert c.check(now + t) is None  # not rank 0's crash: n2 has not beaten since
    agents["n1"].beat_agent("n1", 0.1)
    f = c.check(now + 6.0)
    assert (f.cause, f.rank, f.node) == ("node_lost", None, "n2")


def test_a_finished_rank_that_left_is_no_fault_nor_is_another_attempt(job):
    c, agents, now = job
    agents["n1"].publish_rank(0, record(4, "done", now), "n1", "gone")
    agents["n1"].publish_rank(1, record(3, "forward", now, attempt=0), "n1", "gone")
    agents["n1"].report_exit(1, 1, "", "n1", 0)
    assert c.check(now) is None


def test_the_exit_codes_are_the_supervisors():
    assert (coord.EXIT_USER_ERROR, coord.EXIT_PREEMPTED) == (
        supervisor.EXIT_USER_ERROR,
        supervisor.EXIT_PREEMPTED,
    )


def test_a_stopped_rank_is_the_hang_culprit_by_its_published_state(job):
    c, agents, now = job
    done = {"forward": 0.2, "backward": 0.3}
    for r in range(4):  # every rank overstays: the others wait for the stopped one
        node, state = ("n1", "S") if r < 2 else ("n2", "T" if r == 3 else "S")
        agents[node].publish_rank(r, record(3, "backward", now - 2.0, done=done), node, state)
    f = c.check(now)
    assert (f.cause, f.rank, f.node, f.state) == ("hang", 3, "n2", "T")
    assert "stopped (SIGSTOP)" in f.detail and "limit 1.0 s" in f.detail


def test_a_phase_not_yet_completed_keeps_the_start_up_grace(job):
    c, agents, now = job
    agents["n1"].publish_rank(0, record(0, "forward", now - 3.0), "n1", "R")
    assert c.check(now) is None  # a phase it never completed: initial 5 s, not the 1 s floor
    agents["n1"].publish_rank(0, record(0, "forward", now - 6.0), "n1", "R")
    f = c.check(now)
    assert (f.cause, f.rank) == ("hang", 0)


def test_a_silent_agent_is_node_lost_and_its_ranks_are_not_blamed(job):
    c, agents, now = job
    assert c.check(now) is None
    agents["n1"].beat_agent("n1", 0.1)
    # n2's agent is gone; its ranks' last words look stuck by now, and one looks dead
    done = {"data": 0.05, "forward": 0.2, "backward": 0.3, "optimizer": 0.1}
    agents["n2"].publish_rank(2, record(3, "forward", now - 30, done=done), "n2", "gone")
    assert c.check(now + 0.5) is None  # no verdict on anyone while n2 may only be late
    agents["n1"].beat_agent("n1", 0.1)
    # Its ranks' forward limit (1 s: the floor, 3 x 0.2 s learned) is the agent's too.
    f = c.check(now + 2.0)
    assert (f.cause, f.rank, f.node) == ("node_lost", None, "n2")
    assert f.describe() == "node n2: node_lost (agent silent for 2.0 s, limit 1.0 s)"


def _three_nodes(server, tmp_path, home: str, starting: bool = False):
    """Ranks 0, 1, 2 on nodes n0, n1, n2; the store on `home`; `starting`: ranks not yet past
    start-up (their agents get the 5 s agent time-out, not the 1 s hang limit)."""
    agents = {n: client(server) for n in ("n0", "n1", "n2")}
    now = time.time()
    done = {"data": 0.05, "forward": 0.2, "backward": 0.3, "optimizer": 0.1}
    for r, (n, c) in enumerate(agents.items()):
        c.register_node(n)
        c.beat_agent(n, 0.1)
        rec = record(-1, "init", now) if starting else record(3, "forward", now - 0.1, done=done)
        c.publish_rank(r, rec, n, "S")
    timeouts = Timeouts(tmp_path / "t.json", factor=3.0, floor=1.0, initial=5.0)
    c = Coordinator(server, 3, timeouts, agent_timeout_s=5.0, attempt=1,
                    nodes=list(agents), home=home)  # fmt: skip
    assert c.check(now) is None
    return c, agents, now


@pytest.mark.parametrize("home, silent", [("n0", "n1, n2"), ("spare", "n0, n1, n2")])
def test_every_other_node_silent_at_once_is_the_stores_node_cut_off(tmp_path, server, home,
                                                                      silent):  # fmt: skip
    # n0's link is cut: n1's and n2's agents cannot reach the store any more; n0's own agent
    # still can, from inside its node. Or the store is on a hot spare whose link is cut.
    c, agents, now = _three_nodes(server, tmp_path, home)
    for t in (0.5, 1.0, 2.0):
        if home == "n0":
            agents["n0"].beat_agent("n0", 0.1)
        f = c.check(now + t)
    assert (f.cause, f.rank, f.node) == ("node_lost", None, home)
    assert f"unreachable from every other node ({silent})" in f.detail
    assert f.describe().endswith("its link is cut)")


def test_nodes_that_went_quiet_one_after_the_other_are_not_the_stores_node(tmp_path, server):
    # n2 goes quiet at 0, n1 at 2 s: two deaths, not one cut (a cut silences both at once).
    c, agents, now = _three_nodes(server, tmp_path, "n0", starting=True)
    for t in (1.0, 2.0):
        for n in ("n0", "n1"):
            agents[n].beat_agent(n, 0.1)
        assert c.check(now + t) is None
    for t in (3.5, 5.5):
        agents["n0"].beat_agent("n0", 0.1)
        f = c.check(now + t)
    assert (f.cause, f.node) == ("node_lost", "n2")


def test_one_silent_node_of_three_is_that_node_lost(tmp_path, server):
    c, agents, now = _three_nodes(server, tmp_path, "n0")
    for t in (0.5, 1.0, 2.0):
        for n in ("n0", "n1"):
            agents[n].beat_agent(n, 0.1)
        f = c.check(now + t)
    assert (f.cause, f.node) == ("node_lost", "n2")


def test_with_two_nodes_the_silent_one_is_named_even_if_the_store_is_on_the_other(job):
    # A partition of two: either side looks the same from the store; the silent side is named.
    c, agents, now = job
    c.home = "n1"
    agents["n1"].beat_agent("n1", 0.1)
    assert c.check(now + 0.5) is None
    agents["n1"].beat_agent("n1", 0.1)
    f = c.check(now + 2.0)
    assert (f.cause, f.node) == ("node_lost", "n2")


def test_an_agent_whose_ranks_are_starting_gets_the_agent_timeout(job):
    c, agents, now = job
    for r in (2, 3):  # n2's ranks are still starting (no phase completed: start-up grace)
        agents["n2"].publish_rank(r, record(-1, "init", now), "n2", "S")
    assert c.check(now) is None
    agents["n1"].beat_agent("n1", 0.1)
    assert c.check(now + 4.9) is None  # under agent_timeout_s = 5
    f = c.check(now + 5.5)
    assert (f.cause, f.node) == ("node_lost", "n2") and "limit 5.0 s" in f.detail


def test_a_host_whose_clock_lags_shows_no_false_hang(job, monkeypatch):
    c, agents, _ = job
    lag, real = 100.0, time.time

    def beat_n2_on_its_clock() -> None:
        monkeypatch.setattr(time, "time", lambda: real() - lag)
        agents["n2"].beat_agent("n2", 0.1)
        monkeypatch.setattr(time, "time", real)

    beat_n2_on_its_clock()
    done = {"forward": 0.2}
    agents["n2"].publish_rank(2, record(3, "forward", real() - lag - 0.1, done=done), "n2", "S")
    assert c.check(real()) is None  # 100 s "ago" on n2's clock is 0.1 s ago
    agents["n2"].publish_rank(2, record(3, "forward", real() - lag - 3.0, done=done), "n2", "S")
    agents["n1"].beat_agent("n1", 0.1)
    beat_n2_on_its_clock()
    f = c.check(real())
    assert (f.cause, f.rank, f.node) == ("hang", 2, "n2")
    assert abs(f.t_fault - (real() - 3.0)) < 1.0  # when it stalled, on the coordinator's clock


def test_the_final_look_names_a_death_without_waiting_for_beats(job):
    # The attempt ended (a launcher exited): no more beats will come; name it now.
    c, agents, now = job
    agents["n2"].publish_rank(3, record(3, "backward", now - 0.1), "n2", "gone")
    assert c.check(now) is None
    f = c.check(now, final=True)
    assert (f.cause, f.rank, f.node) == ("process_crash", 3, "n2")


def test_the_dead_ranks_own_node_need_not_beat_again(job):
    # n2 reported its rank's death (so it was up); its agent may exit with its launcher.
    c, agents, now = job
    agents["n2"].publish_rank(3, record(3, "backward", now - 0.1), "n2", "gone")
    assert c.check(now) is None
    for _ in range(2):
        agents["n1"].beat_agent("n1", 0.1)
    assert (c.check(now).rank, c.check(now).node) == (3, "n2")


def test_agents_of_nodes_outside_the_attempt_are_not_watched(job, server):
    c, agents, now = job
    spare = client(server)
    spare.register_node("n3")  # a spare started ahead for a node evicted since: silent
    spare.beat_agent("n3", 0.1)
    c.nodes = {"n1", "n2"}
    for t in (0.0, 6.0, 12.0):
        for n, a in agents.items():
            a.beat_agent(n, 0.1)
        assert c.check(now + t) is None or c.check(now + t).node != "n3"


def test_the_store_process_outlives_a_jobs_stop_signals_and_ends_with_its_stdin():
    """The store serves until whoever started it is gone (stdin closed) or it is killed with
    its node: SIGTERM/SIGINT/SIGHUP are the job's last-gasp signals, not the store's."""
    import json
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "wanka.control.store_server", "--host", "127.0.0.1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = json.loads(p.stdout.readline())["port"]
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            p.send_signal(sig)
        time.sleep(0.3)
        assert p.poll() is None
        c = ControlStore.connect("127.0.0.1", port, "job1", timeout_s=CONNECT_S)
        c.register_node("n0")
        assert c.nodes() == ["n0"]
        p.stdin.close()
        assert p.wait(timeout=10) == 0
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("code, cause", [(-signal.SIGKILL, "node_lost"), (1, "process_crash"),
                                         (-signal.SIGSEGV, "process_crash")])  # fmt: skip
def test_only_a_store_killed_with_its_node_is_held_against_the_node(code, cause):
    from types import SimpleNamespace

    from wanka.resilience.store_attempt import StoreControl

    sc = StoreControl(SimpleNamespace(chaos=SimpleNamespace(fault_time=lambda rank, node: None)))
    sc.primary = SimpleNamespace(proc=SimpleNamespace(returncode=code, poll=lambda: code),
                                 node=SimpleNamespace(name="n0"))  # fmt: skip
    out = SimpleNamespace()
    assert sc._store_lost(out, 100.0) and sc._stop_event.is_set()
    assert (out.cause, out.node, out.rank, out.t_detect) == (cause, "n0", None, 100.0)


class _FakeStore:
    """A control store's process as StoreControl sees it (see store_attempt.StoreProcess)."""

    def __init__(self, node: str, alive: bool = True) -> None:
        from types import SimpleNamespace

        self.node = SimpleNamespace(name=node, addr=f"10.0.0.{node[-1]}")
        self.proc = SimpleNamespace(poll=lambda: None if self.up else -9, returncode=-9)
        self.up, self.stopped = alive, False
        self.client = SimpleNamespace(store=None, host=self.node.addr, port=29400)

    def alive(self) -> bool:
        return self.up

    def attach(self, job, timeout_s=0):
        return self.client


@pytest.fixture
def control(tmp_path, monkeypatch):
    """A StoreControl on stand-in stores and nodes: which store each attempt uses."""
    from types import SimpleNamespace

    from wanka.resilience import store_attempt as sa

    stopped = []
    monkeypatch.setattr(sa, "Coordinator", lambda *a, **k: None)
    monkeypatch.setattr(sa, "stop_store", lambda proc: stopped.append(proc))
    monkeypatch.setattr(sa, "spawn_store", lambda node: _FakeStore(node.name))
    closes = []
    sup = SimpleNamespace(outcomes=[], _warm=SimpleNamespace(close=lambda: closes.append(1)),
                          nproc=1, job="j", timeouts=None, dir=tmp_path, run_dir=tmp_path,
                          cluster=SimpleNamespace(node=lambda n: SimpleNamespace(root="")))  # fmt: skip
    sc = sa.StoreControl(sup)
    nodes = [SimpleNamespace(name=n, addr="a", netns="x") for n in ("n0", "n1", "n2")]
    return sc, sup, nodes, closes, stopped


def _begin(sc, attempt: int, nodes: list, spares: list = ()) -> None:
    """begin, then wait for the stores it stops in the background (the asserts read them)."""
    sc.begin(attempt, nodes, spare_nodes=list(spares))
    for reaper in sc._reapers.threads:
        reaper.join()


def _attempt(sc, attempt: int, nodes: list, spares: list = ()) -> None:
    """An attempt as run_attempt drives the store: begin, then (its ranks train) the standby."""
    _begin(sc, attempt, nodes, spares)
    sc.when_training([*nodes, *spares])


def test_the_store_stays_until_lost_or_faulted_and_the_standby_takes_over(control):
    sc, sup, nodes, closes, stopped = control
    sc.primary = p = _FakeStore("n0")
    sc.begin(1, nodes)
    assert sc.standby is None  # not under the ranks' start-up: spawned once they train
    sc.when_training(nodes)
    s = sc.standby
    assert s is not None and s.node.name == "n1"  # on another node than the primary's
    sup.outcomes.append(SimpleNamespace(node="n2"))  # a rank on n2 crashed: nothing moves
    _attempt(sc, 2, nodes)
    assert sc.primary is p and sc.standby is s
    # The standby's node is the one the last fault was named on: replaced, never used.
    sup.outcomes.append(SimpleNamespace(node="n1"))
    _begin(sc, 3, nodes)
    assert sc.primary is p and s.proc in stopped and sc.standby is None
    sc.when_training(nodes)
    assert sc.standby.node.name == "n2"
    # The primary's node named (a cut link, a frozen host: its store may look alive): the
    # standby serves.
    sup.outcomes.append(SimpleNamespace(node="n0"))
    _attempt(sc, 4, nodes)
    assert sc.primary.node.name == "n2" and p.proc in stopped and sc.standby.node.name == "n1"
    # The primary lost: the standby serves.
    sc.primary.up = False
    sup.outcomes.append(SimpleNamespace(node="n2"))
    _attempt(sc, 5, nodes)
    assert sc.primary.node.name == "n1" and sc.standby.node.name == "n0"
    assert closes == []  # warm launchers never depend on which store serves


def test_the_next_attempt_does_not_wait_for_a_dropped_store_to_exit(control, monkeypatch):
    """A store process takes ~0.5 s to exit (it imported torch): begin() hands the stop to a
    reaper and returns, close() waits for it. Here the stop blocks until released."""
    from wanka.resilience import store_attempt as sa

    sc, sup, nodes, closes, stopped = control
    release, stopped_by = threading.Event(), {}

    def slow_stop(proc) -> None:
        release.wait(5)
        stopped_by[id(proc)] = threading.current_thread().name

    monkeypatch.setattr(sa, "stop_store", slow_stop)
    sc.primary = p = _FakeStore("n0")
    sup.outcomes.append(SimpleNamespace(node="n0"))  # the primary's node named: it is dropped
    sc.begin(2, nodes)  # a stop in the caller would hold it here for 5 s
    assert sc.primary is not p and id(p.proc) not in stopped_by
    release.set()
    sc.close()  # waits for the dropped store's reaper
    assert stopped_by[id(p.proc)] == "wanka-store-reaper" and sc._reapers.threads == []


def test_launchers_learn_the_store_from_their_orders(control):
    sc, sup, nodes, closes, stopped = control
    sc.primary = _FakeStore("n0")
    sc.begin(1, nodes)
    argv = sc.command(nodes[1], ["x"], 2)  # a warm launcher for the next attempt
    assert "--store-from-orders" in argv and "--host" not in argv
    assert argv[argv.index("--job") + 1] == "j/a2" and argv[-2:] == ["--", "x"]
    orders = sc.orders({"argv": ["train"]})
    assert orders == {"argv": ["train"], "store": {"host": "10.0.0.0", "port": 29400}}


def test_the_standby_store_prefers_a_hot_spare_node(control):
    sc, sup, nodes, closes, stopped = control
    _attempt(sc, 1, nodes[:2], nodes[2:])
    assert sc.primary.node.name == "n0" and sc.standby.node.name == "n2"
    # n1 lost: n2 (the spare, where the standby is) joins; the store stays on n0.
    sup.outcomes.append(SimpleNamespace(node="n1"))
    _attempt(sc, 2, [nodes[0], nodes[2]], [nodes[1]])
    assert sc.primary.node.name == "n0" and sc.standby.node.name == "n2"


CHILD = "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())"


def _agent(server, tmp_path, node: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "wanka.control.agent", "--store-from-orders", "--job", "job1",
         "--node", node, "--hb-dir", str(tmp_path / "hb"), "--poll-s", "0.1", "--",
         sys.executable, "-c", CHILD, str(tmp_path / f"{node}.orders")],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_a_warm_agent_takes_its_store_from_the_orders_and_passes_the_rest_on(tmp_path, server):
    p = _agent(server, tmp_path, "n7")
    orders = {"argv": ["train"], "store": {"host": "127.0.0.1", "port": server.port}}
    out, err = p.communicate((json.dumps(orders) + "\n").encode(), timeout=60)
    assert p.returncode == 0, err.decode()[-2000:]
    assert json.loads((tmp_path / "n7.orders").read_text()) == {"argv": ["train"]}
    assert "n7" in server.nodes()  # it registered with the store the orders named


def test_a_warm_agent_dismissed_before_its_orders_exits_without_a_store(tmp_path, server):
    p = _agent(server, tmp_path, "n8")
    out, err = p.communicate(b"", timeout=60)  # end of input: no attempt for it
    assert p.returncode == 0, err.decode()[-2000:]
    assert (tmp_path / "n8.orders").read_text() == "" and "n8" not in server.nodes()


def test_orders_without_a_store_are_one_line_and_leave_no_child(tmp_path, server):
    p = _agent(server, tmp_path, "n9")
    out, err = p.communicate(b'{"argv": ["train"]}\n', timeout=60)
    assert p.returncode == 1 and "orders without a usable 'store' entry" in err.decode()


@pytest.mark.parametrize("reaches, named", [(False, "n1"), (True, "n2")])
def test_with_two_nodes_a_spare_witness_tells_a_cut_store_node_from_the_other_ones_loss(
    job, reaches, named
):
    # The store is on n1; n2's agent goes quiet. A hot spare outside the attempt cannot reach
    # the store either: n1's link is cut. It can: n2 is the one lost.
    c, agents, now = job
    c.home = "n1"
    asked = []
    c.witness = lambda: asked.append(1) or ("n3", reaches)
    agents["n1"].beat_agent("n1", 0.1)
    assert c.check(now + 0.5) is None and not asked  # n2 not late yet: nobody asked
    agents["n1"].beat_agent("n1", 0.1)
    f = c.check(now + 2.0)
    assert (f.cause, f.node) == ("node_lost", named) and asked
    if named == "n1":
        assert "unreachable from n2 and from n3" in f.detail and f.detail.endswith("link is cut")
