"""resilience.control = "store" on the cluster-in-a-box: the supervisor learns of its ranks only
through the control store (node agents inside the node namespaces, each reading its own node's
heartbeat folder), names a remote fault with its rank and node, and the job recovers. Each
node's /dev/shm and run-state folder are its own (the snapshots too): what a node needs from
another comes over the network.

The CI cases run on 3 nodes with `resilience.spare_nodes=1`: the job trains on n0 and n1 while
n2 stands by with a warm launcher, and takes the place (node rank, so ranks) of a node named
lost or hung. The slow cases without a spare (the lost node itself comes back, cold) run on the
2-node `wanka_cluster`; every case's world is 2 ranks, so one reference digest serves all."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wanka.cluster.fixtures import cluster_up, skip_unless_available
from wanka.cluster.nodes import OWN_RUN_DIR_ENV, node_run_dir
from wanka.resilience.ledger import EvictionPolicy, Fault, FaultLedger

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
SPARE = "resilience.spare_nodes=1"


def train(cluster, tmp_path: Path, name: str, chaos: str | None, *extra: str, world: int = 2,
          own_run_dirs: bool = False):  # fmt: skip
    """`own_run_dirs`: each node sees its own run directory but for `checkpoints/` (shared
    storage, as DCP expects), so whatever else a rank writes there (logs, metrics, the summary,
    the timeline) no other node and not the supervisor can read; the summary comes from n0's."""
    run = tmp_path / name  # snapshots: the default /dev/shm/wanka, each node's own
    sets = ["data.seq_len=64", "train.micro_batch_size=2", f"train.steps={STEPS}",
            "train.warmup_steps=2", "model.index_topk=16", "train.eval_every=1000",
            "data.val_batches=1", "parallel.ep=1", "checkpoint.every=1000",
            "run.tensorboard=false", f'run.dir="{run}"', 'resilience.control="store"',
            f'resilience.ledger="{tmp_path / "faults.sqlite"}"', "resilience.preflight=\"off\"",
            *extra]  # fmt: skip
    argv = [sys.executable, "-m", "wanka.cli", "train", "configs/demo.toml", "--cluster",
            "--nproc", "1", "--cluster-state", cluster.state_dir,
            *(["--chaos", chaos] if chaos else []), *sum((["--set", s] for s in sets), [])]  # fmt: skip
    env = dict(os.environ, **({OWN_RUN_DIR_ENV: "1"} if own_run_dirs else {}))
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    if own_run_dirs:
        assert not (run / "summary.json").exists() and not (run / "metrics.jsonl").exists()
        n0 = next(n for n in cluster.state.nodes if n.name == "n0")
        summary = json.loads((node_run_dir(n0, run) / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["world_size"] == world
        return r, run, summary
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == world
    return r, run, summary


def fault_line(stderr: str, cause: str) -> re.Match:
    m = re.search(rf"wanka train: rank (\d+) on node (n\d): {cause} \((.*)\); restart 1 in", stderr)
    assert m, stderr[-3000:]
    return m


def node_of_rank(cluster, run: Path, rank: int, attempt: int) -> str:
    """Where the rank ran, from its own file in its node's private heartbeat folder (looked at
    from the host: NODE_LOCAL/JOB/NODE/attemptN inside the node)."""
    job = (run / "resilience" / "job_id").read_text().strip()
    found = [n.name for n in cluster.state.nodes
             if Path(n.root, "local", job, n.name, f"attempt{attempt}", f"rank{rank}.node").exists()]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


def resumed_from_snapshot(run: Path, cluster=None) -> list[str]:
    """The ranks whose logs say they resumed from a snapshot (`cluster`: in every node's own
    copy of the run directory)."""
    dirs = [node_run_dir(n, run) for n in cluster.state.nodes] if cluster else [run]
    return [
        p.name
        for d in dirs
        for p in (d / "logs").glob("rank*.log")
        if "resumed from the in-memory snapshot of step" in p.read_text(errors="replace")
    ]


def ledger_fault(tmp_path: Path) -> Fault:
    faults = FaultLedger(str(tmp_path / "faults.sqlite")).faults()
    assert len(faults) == 1, faults
    return faults[0]


@pytest.fixture(scope="module")
def three_nodes():
    skip_unless_available()
    with cluster_up(3, link_gbit=0.5, name="wks", subnet="10.231.6.0/24") as c:
        yield c


@pytest.fixture(scope="module")
def reference(three_nodes, tmp_path_factory):
    _, run, summary = train(three_nodes, tmp_path_factory.mktemp("ref"), "run", None, SPARE)
    # The spare trained nothing: the world is n0 and n1.
    assert [node_of_rank(three_nodes, run, r, attempt=1) for r in (0, 1)] == ["n0", "n1"]
    return summary


def lost_line(stderr: str) -> re.Match:
    m = re.search(r"wanka train: node (n\d): node_lost \((.*)\); restart 1 in", stderr)
    assert m, stderr[-3000:]
    return m


def test_killed_rank_is_named_with_its_node_and_the_job_recovers(three_nodes, tmp_path,
                                                                 reference):  # fmt: skip
    # A slow step after the restart: an inside fault, whose mark the rank writes to its node's
    # own folder and the node's agent publishes through the store.
    # Each node has its own run directory but for the checkpoints: the supervisor learns of
    # the ranks only through the store, the ranks of each other only over the network.
    r, run, summary = train(three_nodes, tmp_path, "run",
                            "kill@step=3,rank=1;slow@step=5,rank=1,ms=50,steps=1", SPARE,
                            own_run_dirs=True)  # fmt: skip
    m = fault_line(r.stderr, "process_crash")
    assert m.group(1) == "1" and "died in" in m.group(3)
    assert m.group(2) == node_of_rank(three_nodes, run, 1, attempt=1)
    # A crashed rank says nothing about its node: no spare takes its place (the rank keeps its
    # node and its snapshot there).
    assert "hot spare" not in r.stderr
    assert node_of_rank(three_nodes, run, 1, attempt=2) == m.group(2)
    fault = ledger_fault(tmp_path)
    assert (fault.cause, fault.rank, fault.node) == ("process_crash", 1, m.group(2))
    assert summary["state_digest"] == reference["state_digest"]
    assert len(resumed_from_snapshot(run, three_nodes)) == 2
    # Nothing went through the shared filesystem: the default mode's folder stayed empty, and
    # no heartbeat landed in the run directory; every rank wrote to its node's own memory.
    assert not list((run / "resilience" / "hb").glob("rank*.hb"))
    assert not list(run.rglob("rank*.hb")) and not list(run.rglob("rank*.node"))
    job = (run / "resilience" / "job_id").read_text().strip()
    node = next(n for n in three_nodes.state.nodes if n.name == m.group(2))
    local = Path(node.root, "local", job, node.name, "attempt2", "chaos", "1.fired")  # 2nd fault
    assert local.is_file()  # the rank marked its own node's folder ...
    kept = run / "resilience" / "chaos" / "1.fired"  # ... the supervisor, from the store
    assert kept.stat().st_mtime == local.stat().st_mtime


@pytest.mark.slow  # the hang limit is waited out; the crash case covers the wiring in CI
def test_stopped_rank_is_a_hang_named_with_its_node(three_nodes, tmp_path, reference):
    r, run, summary = train(three_nodes, tmp_path, "run", "stop@step=3,rank=0", SPARE,
                            "resilience.hang_floor_s=3.0")  # fmt: skip
    m = fault_line(r.stderr, "hang")
    assert m.group(1) == "0" and "stopped (SIGSTOP)" in m.group(3)
    assert m.group(2) == node_of_rank(three_nodes, run, 0, attempt=1) == "n0"
    fault = ledger_fault(tmp_path)
    assert (fault.cause, fault.rank, fault.node) == ("hang", 0, m.group(2))
    # A frozen host is suspect: the spare takes its place.
    assert "hot spare n2 takes the place of n0" in r.stderr
    assert summary["state_digest"] == reference["state_digest"]
    # The stop asked for stacks: n0's agent wrote its ranks' before killing them.
    stacks = (run / "logs" / "stacks-attempt1-n0.txt").read_text()
    assert "rank 0 pid" in stacks and "stopped: no stack can be taken" in stacks, stacks


def test_a_lost_node_is_replaced_by_the_spare(three_nodes, tmp_path, reference):
    # Every process of n1 goes at once (agent, launcher, rank); rank on n0 then dies of the
    # reset connection at once. The node is the cause, with no rank, and it was injected.
    r, run, summary = train(three_nodes, tmp_path, "run", "node_kill@step=3,node=1", SPARE)
    m = lost_line(r.stderr)
    assert m.group(1) == "n1" and "agent was killed (SIGKILL)" in m.group(2)
    assert "hot spare n2 takes the place of n1" in r.stderr
    fault = ledger_fault(tmp_path)
    assert (fault.cause, fault.rank, fault.node) == ("node_lost", None, "n1")
    # Injected: kept for the record, never counted toward evicting n1.
    strict = EvictionPolicy(max_faults=1, window_s=3600, same_cause=1)
    assert FaultLedger(str(tmp_path / "faults.sqlite")).evaluate("n1", strict) is None
    # Rank 0 stayed on n0 (its snapshot in n0's memory); rank 1 moved to n2, which had no copy
    # of its state: it got it from n0's replica over the network.
    assert [node_of_rank(three_nodes, run, r, attempt=2) for r in (0, 1)] == ["n0", "n2"]
    assert len(resumed_from_snapshot(run)) == 2
    assert summary["state_digest"] == reference["state_digest"]
    assert "restart 2" not in r.stderr  # one fault: the spare was not taken for a lost node


# Without a spare: the lost node itself comes back, cold (the spare case above covers naming,
# ledger and replica restore in CI).
@pytest.mark.slow
def test_a_killed_node_is_named_node_lost_not_its_peers_crash(wanka_cluster, tmp_path, reference):
    # Every process of n1 goes at once (agent, launcher, rank); rank on n0 then dies of the
    # reset connection at once. The node is the cause, with no rank, and it was injected.
    r, run, summary = train(wanka_cluster, tmp_path, "run", "node_kill@step=3,node=1")
    m = re.search(r"wanka train: node (n\d): node_lost \((.*)\); restart 1 in", r.stderr)
    assert m, r.stderr[-3000:]
    assert m.group(1) == "n1" and "agent was killed (SIGKILL)" in m.group(2)
    fault = ledger_fault(tmp_path)
    assert (fault.cause, fault.rank, fault.node) == ("node_lost", None, "n1")
    # Injected: kept for the record, never counted toward evicting n1.
    strict = EvictionPolicy(max_faults=1, window_s=3600, same_cause=1)
    assert FaultLedger(str(tmp_path / "faults.sqlite")).evaluate("n1", strict) is None
    assert summary["state_digest"] == reference["state_digest"]
    # n1's memory went with it (its snapshot too): its rank got its state back from the copy
    # on n0, over the network, and resumed from the snapshot like n0's rank.
    assert len(resumed_from_snapshot(run)) == 2


def test_losing_the_stores_node_moves_the_store_and_the_job_recovers(three_nodes, tmp_path,
                                                                      reference):  # fmt: skip
    # The control store is a process on n0: a node kill of n0 takes it (and n0's memory, its
    # snapshots with it). Named on n0 at once; the next attempt is served by the standby store
    # (on the spare, n2), which also takes n0's place (its node rank, so rank 0); every agent is
    # told so, and both ranks resume from snapshots: rank 1 stays on n1 with its own, rank 0 on
    # n2 fetches the replica n1 held of it.
    r, run, summary = train(three_nodes, tmp_path, "run", "node_kill@step=3,node=0", SPARE)
    m = lost_line(r.stderr)
    assert m.group(1) == "n0", m.group(0)
    assert "control store moved from n0 to n2" in r.stderr
    assert "hot spare n2 takes the place of n0" in r.stderr
    fault = ledger_fault(tmp_path)
    assert (fault.cause, fault.rank, fault.node) == ("node_lost", None, "n0")
    assert [node_of_rank(three_nodes, run, r, attempt=2) for r in (0, 1)] == ["n2", "n1"]
    assert summary["state_digest"] == reference["state_digest"]
    assert len(resumed_from_snapshot(run)) == 2
    # The job finished: no node keeps a copy (n1 still held rank 1's own folder and the replica
    # of rank 0 from before the move).
    job = (run / "resilience" / "job_id").read_text().strip()
    assert not [n.name for n in three_nodes.state.nodes
                if (Path(n.root) / "shm" / "wanka" / job).exists()]  # fmt: skip


@pytest.mark.slow  # without a spare: the store alternates between the two nodes
def test_losing_the_stores_node_without_a_spare(wanka_cluster, tmp_path, reference):
    r, run, summary = train(wanka_cluster, tmp_path, "run", "node_kill@step=3,node=0")
    assert lost_line(r.stderr).group(1) == "n0"
    assert "control store moved from n0 to n1" in r.stderr
    assert summary["state_digest"] == reference["state_digest"]
    assert len(resumed_from_snapshot(run)) == 2


@pytest.mark.slow  # waits out the hang limit; the node_kill case covers the wiring in CI
def test_a_cut_off_node_is_replaced_without_waiting_for_its_link(three_nodes, tmp_path,
                                                                 reference):  # fmt: skip
    r, run, summary = train(three_nodes, tmp_path, "run", "link_cut@step=3,node=1,for=60",
                            SPARE, "resilience.hang_floor_s=3.0")  # fmt: skip
    assert lost_line(r.stderr).group(1) == "n1"
    assert "hot spare n2 takes the place of n1" in r.stderr
    assert [node_of_rank(three_nodes, run, r, attempt=2) for r in (0, 1)] == ["n0", "n2"]
    assert summary["state_digest"] == reference["state_digest"]


@pytest.mark.slow  # waits out the hang limit and the cut
def test_a_cut_off_store_node_is_named_not_the_nodes_that_lost_it(three_nodes, tmp_path):
    # Three nodes train, the store on n0; n0's link is cut: n1's and n2's agents go quiet,
    # n0's still beats (it reaches the store inside n0). n0 is named (and the next attempt
    # uses the standby store, never a store on the node the fault was named on).
    r, run, summary = train(three_nodes, tmp_path, "run", "link_cut@step=3,node=0,for=8",
                            "resilience.hang_floor_s=3.0", world=3)  # fmt: skip
    m = lost_line(r.stderr)
    assert m.group(1) == "n0" and "unreachable from every other node (n1, n2)" in m.group(2)
    assert "restart 2" not in r.stderr  # and the job went on (train() checks it finished)


def test_spares_that_leave_no_node_to_train_on_are_refused_in_one_line(three_nodes, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "wanka.cli", "train", "configs/demo.toml", "--cluster", "--nproc",
         "1", "--cluster-state", three_nodes.state_dir, "--set", "resilience.spare_nodes=3",
         "--set", f'run.dir="{tmp_path / "run"}"'],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "resilience.spare_nodes=3 leaves no node" in lines[0], lines
