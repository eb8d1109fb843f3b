"""Hot spares and eviction inside a running Slurm job (resilience.control = "store"): the sbatch
script of `wanka launch --slurm` under the stand-in srun on three cluster-in-a-box nodes, each
with its own /dev/shm. The coordinator (n0) plans each attempt's hosts; the others carry it out
(resilience/host_members.py)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.cluster.test_launch_srun import (
    finish,
    kill_node_task,
    shm_of,
    start,
    wait_for_step,
    write_script,
)
from wanka.cluster.fixtures import cluster_up, skip_unless_available
from wanka.resilience.heartbeat import read_all

JOB_ID = "4242"


@pytest.fixture(scope="module")
def cluster():
    skip_unless_available()
    with cluster_up(3, link_gbit=1.0, name="wksp", subnet="10.231.14.0/24") as c:
        yield c


def _kill_a_rank_on(cluster, tmp, node: str, p, at_step: int = 3) -> int:
    """SIGKILL a rank of `node` (found in its own /dev/shm) once training passed `at_step`."""
    n = next(x for x in cluster.state.nodes if x.name == node)
    hb = shm_of(n) / "wanka-control" / f"{JOB_ID}.0" / node / "attempt1"
    wait_for_step(p, tmp, at_step)
    beats = read_all(hb)
    assert beats, (tmp / "slurm.out").read_text()[-4000:]
    rank = min(beats)
    os.kill(beats[rank].pid, signal.SIGKILL)
    return rank


def _faults_and_resumes(run):
    events = [
        json.loads(x) for x in (run / "resilience" / "timeline.jsonl").read_text().splitlines()
    ]
    faults = [(e["cause"], e["node"]) for e in events if e.get("kind") == "fault"]
    evicts = [e["node"] for e in events if e.get("kind") == "evict"]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    resumes = [(r["source"], r["step"]) for r in rows if r.get("kind") == "resume"]
    return faults, evicts, resumes


def _resumed_from_foreseen_snapshot(out: str, resumes: list) -> int:
    """n2 took n1's place and the ranks resumed from the in-memory snapshots, at the step the
    coordinator foresaw from the hosts' snapshot inventories in the store; returns it."""
    [(source, step)] = resumes
    assert source == "memory", resumes  # the same world: snapshots, not the disk
    assert (
        "next attempt on n0, n2: n2 takes the place of n1; the ranks resume from the "
        f"in-memory snapshots of step {step}"
    ) in out, out[-4000:]
    return step


def test_a_hot_spare_takes_an_evicted_hosts_place_and_the_job_finishes(cluster, tmp_path):
    """3 hosts, 2 train, n2 stands by. A rank killed on n1 with evict_after = 1: the
    coordinator evicts n1, the spare n2 trains in its place on the same world size (ranks
    restore from the in-memory snapshots, n2's from copies it fetches), n1 stands by until the
    end, and every host's task exits 0."""
    steps = 30
    extra = ('resilience.control="store"', "resilience.spare_nodes=1", "resilience.evict_after=1")
    script = write_script(tmp_path, steps=steps, every=1000, extra=extra, nodes=3)
    p = start(cluster, tmp_path, script, private_shm=True)
    _kill_a_rank_on(cluster, tmp_path, "n1", p)
    rc = finish(p, tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 0, out[-4000:]
    assert "node n2 stands by (a hot spare) while attempt 1 trains on n0, n1" in out, out[-4000:]
    assert "on node n1: process_crash" in out, out[-4000:]
    assert "evicting node n1" in out, out[-4000:]
    assert "node n1 stands by (evicted) while attempt 2 trains on n0, n2" in out, out[-4000:]
    run = tmp_path / "run"
    faults, evicts, resumes = _faults_and_resumes(run)
    assert faults == [("process_crash", "n1")] and evicts == ["n1"]
    _resumed_from_foreseen_snapshot(out, resumes)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2
    for i in range(3):  # every task ended 0: the evicted host and the spare too
        assert f"n{i}: task {i}: Exited with exit code" not in out, out[-4000:]


def test_without_a_spare_the_job_goes_on_without_the_evicted_host(cluster, tmp_path):
    """3 hosts train (ep 1); n2 evicted after its rank's crash: the job continues on n0, n1
    with a smaller world, from the DCP checkpoint (snapshots fit only their own world size)."""
    steps = 30
    extra = ('resilience.control="store"', "resilience.evict_after=1", "parallel.ep=1")
    script = write_script(tmp_path, steps=steps, every=2, extra=extra, nodes=3)
    p = start(cluster, tmp_path, script, private_shm=True)
    _kill_a_rank_on(cluster, tmp_path, "n2", p, at_step=4)
    rc = finish(p, tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 0, out[-4000:]
    assert (
        "next attempt on n0, n1: continuing without n2; the ranks resume from the newest checkpoint"
    ) in out, out[-4000:]
    assert "node n2 stands by (evicted) while attempt 2 trains on n0, n1" in out, out[-4000:]
    run = tmp_path / "run"
    faults, evicts, resumes = _faults_and_resumes(run)
    assert faults == [("process_crash", "n2")] and evicts == ["n2"]
    assert [source for source, _ in resumes] == ["disk"], resumes
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2


def test_a_killed_host_is_replaced_by_the_spare_within_the_job(cluster, tmp_path):
    """Every process of n1's task killed at once (its host went). The coordinator names n1
    lost from its agent's silence, the spare n2 takes its place, the ranks restore from the
    snapshots (n1's from the copy its buddy kept) and the job finishes. srun's own status is
    the killed task's (128 + 9); the script exits with the coordinator's word instead (0), so
    a lost host hides neither a finished job nor a last gasp's requeue."""
    steps = 40
    extra = ('resilience.control="store"', "resilience.spare_nodes=1")
    script = write_script(tmp_path, steps=steps, every=1000, extra=extra, nodes=3)
    run = tmp_path / "run"
    p = start(cluster, tmp_path, script, private_shm=True)
    wait_for_step(p, tmp_path, 4)
    t_kill = time.time()
    kill_node_task(tmp_path, 1)
    rc = finish(p, tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 0, out[-4000:]
    assert "node n1: node_lost" in out, out[-4000:]
    assert "n1: task 1: SIGKILL" in out and "task 0: Exited" not in out, out[-4000:]
    assert "task 2: Exited" not in out, out[-4000:]
    faults, evicts, resumes = _faults_and_resumes(run)
    assert faults == [("node_lost", "n1")] and evicts == []
    step = _resumed_from_foreseen_snapshot(out, resumes)  # n1's copies: kept by its buddy
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    t_back = min(r["time"] for r in rows if r.get("kind") == "train" and r["time"] > t_kill
                 and r["step"] > step)  # fmt: skip
    print(f"n1 killed: training again on n0 + n2 {t_back - t_kill:.1f} s later")
