"""Chaos faults on a reused run directory, node= faults on a single host, and injected
fail_start faults seen as injected (resilience/chaos.py)."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from wanka.resilience.chaos import ChaosDriver, WorkerChaos, parse_schedule
from wanka.resilience.heartbeat import Beat


class _Timeline:
    def event(self, *a, **kw) -> None:
        pass


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen]]:
    """Processes standing in for ranks (and the job), for faults that send signals."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen]) -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "30"])
    procs.append(p)
    return p


def _driver(schedule: str, run: Path, job_pid: int | None = None) -> ChaosDriver:
    return ChaosDriver(parse_schedule(schedule), run, "job", str(run / "shm"), _Timeline(),
                       job_pid=job_pid)  # fmt: skip


def _beats(pids: dict[int, int], step: int) -> dict[int, Beat]:
    now = time.time()
    return {r: Beat(r, pid, 0, step, "forward", now, now, {}) for r, pid in pids.items()}


def _dead(p: subprocess.Popen) -> bool:
    try:
        p.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return False
    return True


# -- fired marks: keyed by the fault, not only its place in the schedule ----------------------


def test_a_mark_of_another_schedule_does_not_suppress_a_fault(tmp_path, sleepers):
    run = tmp_path / "run"
    job = _sleeper(sleepers)
    first = _driver("sigterm@step=2", run, job_pid=job.pid)
    first.poll(_beats({0: job.pid}, 2), time.time(), 1, node_of=lambda r: "vm")
    assert first.fired and _dead(job)  # fired, and marked RUN_DIR/resilience/chaos
    rank0 = _sleeper(sleepers)
    second = _driver("kill@step=6,rank=0", run)  # the same run directory, another schedule
    assert not second.fired
    second.poll(_beats({0: rank0.pid}, 5), time.time(), 1, node_of=lambda r: "vm")
    assert _dead(rank0)


def test_the_same_schedule_resumed_does_not_replay_what_fired(tmp_path, sleepers):
    run = tmp_path / "run"
    rank0 = _sleeper(sleepers)
    _driver("kill@step=3,rank=0", run).poll(_beats({0: rank0.pid}, 2), time.time(), 1,
                                            node_of=lambda r: "vm")  # fmt: skip
    assert _dead(rank0)
    again = _sleeper(sleepers)
    resumed = _driver("kill@step=3,rank=0", run)  # a resubmitted job, the same --chaos
    assert 0 in resumed.fired
    resumed.poll(_beats({0: again.pid}, 4), time.time(), 1, node_of=lambda r: "vm")
    assert not _dead(again)


def test_inside_marks_are_keyed_by_the_fault(tmp_path):
    run = tmp_path / "run"
    marks = run / "resilience" / "chaos"
    driver = _driver("nan@step=2,rank=0", run)
    rank = WorkerChaos(driver.worker_spec(), 0, marks)
    assert rank.nan_now(1) and (marks / "0.fired").is_file()  # drill.py reads the position
    assert "nan" not in _driver("nan@step=2,rank=0", run).worker_spec()  # not replayed
    other = _driver("nan@step=5,rank=0", run).worker_spec()  # another fault at position 0
    assert other.startswith("nan@step=5")
    # What the control store reports (fault id -> when, node) is marked the same way.
    store = _driver("slow@step=3,rank=0;nan@step=4,rank=0", tmp_path / "run2")
    store.note_fired({1: (time.time(), "n0")})
    assert _driver("slow@step=3,rank=0;nan@step=4,rank=0", tmp_path / "run2").worker_spec() == (
        "slow@step=3,rank=0,id=0"
    )
    assert "nan@step=4" in _driver("nan@step=4,rank=1", tmp_path / "run2").worker_spec()


# -- node= on a job of one host -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("node", "env", "fails"),
    [
        (0, {"WANKA_NODE": "vm", "GROUP_RANK": "0"}, True),  # a plain host: node 0
        (0, {"WANKA_NODE": "vm"}, True),  # no torch elastic node rank: the one host
        (1, {"WANKA_NODE": "vm", "GROUP_RANK": "0"}, False),
        (1, {"WANKA_NODE": "gpu7", "GROUP_RANK": "1"}, True),  # a job across hosts: node rank
        (1, {"WANKA_NODE": "n1", "GROUP_RANK": "0"}, True),  # cluster-in-a-box: n1 is node 1
        (0, {"WANKA_NODE": "n1", "GROUP_RANK": "0"}, False),
    ],
)
def test_fail_start_names_a_node_by_index(tmp_path, monkeypatch, node, env, fails):
    monkeypatch.delenv("GROUP_RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rank = WorkerChaos(f"fail_start@node={node},times=1,id=0", 0, tmp_path)
    if fails:
        with pytest.raises(SystemExit, match="fails at start-up"):
            rank.at_start()
    else:
        rank.at_start()


def test_node_kill_of_node_0_on_one_host_kills_its_ranks(tmp_path, sleepers):
    ranks = {r: _sleeper(sleepers) for r in (0, 1)}
    driver = _driver("node_kill@step=3,node=0", tmp_path / "run")
    driver.poll(_beats({r: p.pid for r, p in ranks.items()}, 2), time.time(), 1,
                node_of=lambda r: "vm")  # fmt: skip
    assert all(_dead(p) for p in ranks.values())
    assert driver.fault_time(0, "vm") is not None and driver.fault_time(None, "vm") is not None


def test_node_kill_of_a_node_the_job_lacks_is_said(tmp_path, sleepers, capsys):
    rank0 = _sleeper(sleepers)
    driver = _driver("node_kill@step=3,node=1", tmp_path / "run")
    driver.poll(_beats({0: rank0.pid}, 2), time.time(), 1, node_of=lambda r: "vm")
    assert not _dead(rank0) and 0 in driver.fired  # never retried
    assert "node_kill@step=3,node=1 not injected: the job has 1 node(s)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("schedule", "world", "nodes", "refused"),
    [
        ("fail_start@node=1,times=2", 1, None, "node=1, but the job has at most 1 node"),
        ("node_kill@step=3,node=2", 4, 2, "node=2, but the job has 2 node(s): 0..1"),
        ("link_cut@t=5,node=1", None, 1, "node=1, but the job has 1 node(s): 0..0"),
        ("node_kill@step=3,node=1", 4, 2, None),
        ("fail_start@node=0", 1, 1, None),
    ],
)
def test_a_node_beyond_the_job_is_refused(schedule, world, nodes, refused):
    if refused is None:
        parse_schedule(schedule, world, nodes=nodes)
        return
    with pytest.raises(ValueError, match=re.escape(refused)) as e:
        parse_schedule(schedule, world, nodes=nodes)
    assert "\n" not in str(e.value)


# -- fail_start: what it does is the drill's doing ----------------------------------------------


def test_fail_start_faults_are_injected(tmp_path):
    driver = _driver("fail_start@times=2", tmp_path / "run")
    for _ in range(2):  # two attempts get it; their start-up failures are injected
        assert "fail_start" in driver.worker_spec()
        assert driver.fault_time(0, "vm") is not None  # rank 0's death, named
        assert driver.fault_time(None, None) is not None  # the exit codes alone
    assert driver.worker_spec() == ""  # the third attempt does not: its faults are its own
    assert driver.fault_time(0, "vm") is None and driver.fault_time(None, None) is None


def test_fail_start_of_one_node_is_injected_on_that_node(tmp_path):
    driver = _driver("fail_start@node=1,times=1", tmp_path / "run")
    driver.worker_spec()
    assert driver.fault_time(None, "n1") is not None
    assert driver.fault_time(2, "n0") is None  # another node's own fault


def test_a_counted_fail_start_drills_the_eviction_policy(tmp_path):
    """counted=1: the start-up failures are recorded as the node's own (what an eviction drill
    needs); without it they never count (above)."""
    driver = _driver("fail_start@node=1,times=2,counted=1", tmp_path / "run")
    assert "fail_start@node=1,times=2,counted=1" in driver.worker_spec()
    assert driver.fault_time(None, "n1") is None and driver.fault_time(None, None) is None
    with pytest.raises(ValueError, match="counted is 0 or 1"):
        parse_schedule("fail_start@times=1,counted=2")
