"""The control plane across real processes. Two "nodes", each an agent process that watches its
own private heartbeat folder, written by its own fake ranks (resilience.heartbeat.Reporter in a
loop). The coordinator runs here and knows the job only through the TCPStore: it is given no
path, and every check runs with file reads trapped."""

from __future__ import annotations

import builtins
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from wanka.control.coordinator import ControlFault, Coordinator
from wanka.control.store import ControlStore
from wanka.resilience.monitor import Timeouts

# Process start-up and detection within seconds: run alone, not next to other tests' load.
pytestmark = pytest.mark.serial

T = TypeVar("T")
ATTEMPT = 1
LAYOUT = {"n1": [0, 1], "n2": [2]}  # node -> its ranks
WORLD = 3
# A rank of attempt 1 that steps through four short phases forever.
FAKE_RANK = """
import sys, time
from pathlib import Path
from wanka.resilience.heartbeat import Reporter
rep = Reporter(Path(sys.argv[1]), int(sys.argv[2]), attempt=1)
step = 0
while True:
    for phase in ("data", "forward", "backward", "optimizer"):
        rep.enter(phase, step)
        time.sleep(0.05)
    step += 1
"""


@dataclass
class Node:
    name: str
    ranks: dict[int, subprocess.Popen]
    ranks_pgid: int  # the stand-in for this node's torchrun: its ranks' process group
    agent: subprocess.Popen


def wait_for(what: Callable[[], T], timeout_s: float, every_s: float = 0.1) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"nothing within {timeout_s} s")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def job(tmp_path):
    """The store served here; per node, its ranks in one process group and an agent process."""
    store = ControlStore.serve("127.0.0.1", 0, "job1", timeout_s=30)
    env = dict(os.environ)
    nodes: dict[str, Node] = {}
    groups: list[int] = []
    try:
        for name, ranks in LAYOUT.items():
            hb_dir = tmp_path / name / "hb"  # private to the node: nobody else is told of it
            procs, pgid = {}, 0
            for r in ranks:
                p = subprocess.Popen([sys.executable, "-c", FAKE_RANK, str(hb_dir), str(r)],
                                     env={**env, "WANKA_NODE": name}, process_group=pgid)  # fmt: skip
                pgid = pgid or p.pid  # the first rank leads the group, the others join it
                procs[r] = p
            groups.append(pgid)
            log = open(tmp_path / f"agent-{name}.log", "w")  # noqa: SIM115 (closed with the test)
            agent = subprocess.Popen(
                [sys.executable, "-m", "wanka.control.agent", "--host", "127.0.0.1",
                 "--port", str(store.port), "--job", "job1", "--node", name,
                 "--hb-dir", str(hb_dir), "--poll-s", "0.1", "--pgid", str(pgid),
                 "--attempt", str(ATTEMPT)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            groups.append(agent.pid)
            nodes[name] = Node(name, procs, pgid, agent)

        def ready() -> bool:  # every rank past a whole step, every agent beating
            ranks = store.read_ranks(WORLD)
            steps_done = len(ranks) == WORLD and all(r.beat.step >= 1 for r in ranks.values())
            return steps_done and set(store.read_agents()) == set(LAYOUT)

        wait_for(ready, 40)  # agents import torch; a TCPStore connect may stall for 5 s
        yield store, nodes
    finally:
        for pgid in groups:
            _kill_group(pgid)
        for n in nodes.values():
            for p in [*n.ranks.values(), n.agent]:
                p.wait(timeout=10)


def coordinator(store: ControlStore, tmp_path: Path, floor: float) -> Coordinator:
    # The learned limits' own file, on the coordinator's side; it is never written here.
    timeouts = Timeouts(tmp_path / "coordinator" / "timeouts.json", 3.0, floor, initial=10.0)
    return Coordinator(store, WORLD, timeouts, agent_timeout_s=3.0, attempt=ATTEMPT)


def first_fault(c: Coordinator, monkeypatch, timeout_s: float) -> ControlFault:
    """Poll the coordinator until it names a fault, failing it if it opens any file or lists
    any folder (heartbeat files, exit marks, /proc) on the way."""
    touched: list[str] = []

    def trap(real: Callable) -> Callable:
        def wrapper(path=".", *args, **kw):
            touched.append(str(path))
            return real(path, *args, **kw)

        return wrapper

    with monkeypatch.context() as m:
        for owner, name in ((builtins, "open"), (io, "open"), (os, "scandir"), (os, "listdir")):
            m.setattr(owner, name, trap(getattr(owner, name)))
        fault = wait_for(c.check, timeout_s)
    assert touched == [], f"the coordinator read {touched}"
    return fault


def test_a_killed_rank_is_a_crash_named_on_its_node(job, tmp_path, monkeypatch):
    store, nodes = job
    c = coordinator(store, tmp_path, floor=10.0)
    assert c.check() is None
    victim = nodes["n1"].ranks[1]
    victim.kill()
    victim.wait()  # reaped at once, as torchrun would: its pid is gone, not a zombie
    t0 = time.monotonic()
    fault = first_fault(c, monkeypatch, timeout_s=10)
    assert (fault.cause, fault.rank, fault.node, fault.state) == ("process_crash", 1, "n1", "gone")
    assert time.monotonic() - t0 < 5
    assert fault.describe().startswith("rank 1 on node n1: process_crash (rank 1 died in ")


def test_a_stopped_rank_is_a_hang_with_state_t(job, tmp_path, monkeypatch):
    store, nodes = job
    c = coordinator(store, tmp_path, floor=1.5)
    os.kill(nodes["n2"].ranks[2].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    fault = first_fault(c, monkeypatch, timeout_s=10)
    assert (fault.cause, fault.rank, fault.node, fault.state) == ("hang", 2, "n2", "T")
    assert "stopped (SIGSTOP)" in fault.detail
    assert 1.5 <= time.monotonic() - t0 + 0.2 < 6  # its last phase began up to 0.2 s before


def test_a_killed_agent_is_node_lost_and_its_ranks_are_not_blamed(job, tmp_path, monkeypatch):
    store, nodes = job
    c = coordinator(store, tmp_path, floor=10.0)
    assert c.check() is None
    nodes["n2"].agent.kill()  # its ranks run on, unseen
    t0 = time.monotonic()
    fault = first_fault(c, monkeypatch, timeout_s=12)
    assert (fault.cause, fault.rank, fault.node) == ("node_lost", None, "n2")
    assert 3.0 <= time.monotonic() - t0 + 0.2 < 8
    assert all(p.poll() is None for p in nodes["n2"].ranks.values())


def test_a_stop_decision_makes_each_agent_kill_its_group(job, tmp_path):
    store, nodes = job
    decision = coordinator(store, tmp_path, floor=10.0).decide_stop(ATTEMPT, "test teardown")

    def all_done() -> dict | None:
        done = store.read_done()
        return done if set(done) == set(LAYOUT) else None

    done = wait_for(all_done, 10)
    for name, node in nodes.items():
        assert done[name]["seq"] == decision["seq"]
        assert done[name]["detail"] == f"killed process group {node.ranks_pgid}"
        for p in node.ranks.values():
            assert p.wait(timeout=5) == -signal.SIGKILL
        assert node.agent.poll() is None  # the agent outlives the attempt it stopped
