"""`wanka launch --slurm` end to end: the generated sbatch script, run by bash (no sbatch) with
the stand-in srun/scontrol/scancel (fake_slurm.py) first on PATH, trains a tiny job across the
two nodes of a cluster-in-a-box. Each node's task runs in its network namespace with its own
hostname, which resolves to its own address (as on a real cluster), so the script needs no
testbed-specific flags: c10d finds its host by name, gloo binds the node's address.

Then the time-limit path: USR1 to the batch shell (what `--signal=B:USR1@...` delivers) makes
every rank stop at one step and checkpoint, the script requeues the job, and running the script
again (what Slurm does with a requeued job) resumes from that checkpoint and finishes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wanka.cluster.fixtures import cluster_up, skip_unless_available
from wanka.resilience.ledger import FaultLedger

REPO = Path(__file__).resolve().parents[2]
FAKE_SLURM = Path(__file__).with_name("fake_slurm.py")
JOB_ID = "4242"


@pytest.fixture(scope="module")
def cluster():
    skip_unless_available()
    with cluster_up(2, link_gbit=1.0, name="wksl", subnet="10.231.13.0/24") as c:
        yield c


def write_script(tmp: Path, steps: int, every: int, extra: tuple[str, ...] = (),
                 nodes: int = 2) -> Path:  # fmt: skip
    """The sbatch script for a tiny `nodes`-node x 1-rank job, through the real CLI handler."""
    import argparse

    from wanka.launch.cli import add_launch_parser

    ledger = FaultLedger(tmp / "faults.sqlite")
    ledger.evict("n9", "2 x hang within 3600 s")  # not in this allocation: excluded, no effect
    sets = ["data.seq_len=64", "train.micro_batch_size=2", f"train.steps={steps}",
            "train.warmup_steps=2", "model.index_topk=16", "train.eval_every=1000",
            "data.val_batches=1", f"checkpoint.every={every}", "run.tensorboard=false",
            "train.log_every=1",
            f'run.dir="{tmp / "run"}"', f'data.cache_dir="{tmp / "cache"}"',
            f'resilience.ledger="{tmp / "faults.sqlite"}"',
            f'resilience.snapshot_dir="{tmp / "shm"}"', *extra]  # fmt: skip
    argv = ["launch", "--slurm", "configs/demo.toml", "--nodes", str(nodes), "--nproc", "1",
            "--time", "00:10:00", "--out", str(tmp / "job.sbatch"),
            *sum((["--set", s] for s in sets), [])]  # fmt: skip
    p = argparse.ArgumentParser(prog="wanka")
    add_launch_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(argv)
    a.argv = argv
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert a.fn(a) == 0
    finally:
        os.chdir(cwd)
    script = tmp / "job.sbatch"
    assert "#SBATCH --exclude=n9" in script.read_text()
    return script


def start(cluster, tmp: Path, script: Path, restart: int = 0,
          private_shm: bool = False) -> subprocess.Popen:  # fmt: skip
    """bash SCRIPT as the batch shell of job JOB_ID on the cluster's nodes (SLURM_JOB_NODELIST
    n[0-K]), `restart` times requeued; `private_shm`: each node's task sees its own /dev/shm."""
    bin_dir = tmp / "bin"
    subprocess.run([sys.executable, str(FAKE_SLURM), "install", str(bin_dir)], check=True)
    nodes = cluster.state.nodes
    hosts = tmp / "hosts"  # every node's /etc/hosts: its peers by name, as DNS would have them
    hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in nodes))
    fake_nodes = [{"host": n.name, "netns": n.netns, "hosts": str(hosts)} for n in nodes]
    if private_shm:
        for fake, n in zip(fake_nodes, nodes):
            fake["shm"] = str(shm_of(n))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=JOB_ID,
               SLURM_JOB_NODELIST=f"n[0-{len(nodes) - 1}]", FAKE_SLURM_NODES=json.dumps(fake_nodes),
               FAKE_SLURM_DIR=str(tmp / "slurm"), OMP_NUM_THREADS="1",
               SLURM_RESTART_COUNT=str(restart))  # fmt: skip
    log = open(tmp / "slurm.out", "a")  # noqa: SIM115 - the job's output file, appended
    return subprocess.Popen(["bash", str(script)], env=env, stdout=log, stderr=subprocess.STDOUT)


def shm_of(node) -> Path:
    """Where the host sees the node's own /dev/shm (a fresh folder per node)."""
    shm = Path(node.root or f"/dev/shm/wanka-test-{node.name}") / "shm"
    shm.mkdir(parents=True, exist_ok=True)
    shm.chmod(0o1777)
    return shm


def finish(p: subprocess.Popen, tmp: Path, timeout: float = 240) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(
            "the job did not end:\n" + (tmp / "slurm.out").read_text()[-4000:]
        ) from None


def nodes_seen(run: Path) -> set[str]:
    """The nodes whose supervisors took part (each logs a "job" event naming its node)."""
    lines = (run / "resilience" / "timeline.jsonl").read_text().splitlines()
    return {e.get("node") for e in map(json.loads, lines) if e.get("kind") == "job"}


def wait_for_step(p: subprocess.Popen, tmp: Path, step: int, poll_s: float = 0.1) -> None:
    """Until the job has trained past `step` (it must still be running then)."""
    deadline = time.monotonic() + 180
    while _metrics_step(tmp / "run") < step and p.poll() is None and time.monotonic() < deadline:
        time.sleep(poll_s)
    assert p.poll() is None, (tmp / "slurm.out").read_text()[-4000:]


def kill_node_task(tmp: Path, node_index: int) -> None:
    """SIGKILL every process of one node's task (its host went), as the stand-in srun tracks
    them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_slurm", FAKE_SLURM)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    (step,) = (tmp / "slurm" / "steps").glob(f"{JOB_ID}.*")
    fake.signal_tree([int(step.read_text().split()[node_index])], signal.SIGKILL)


def test_sbatch_script_trains_across_both_nodes(cluster, tmp_path):
    script = write_script(tmp_path, steps=4, every=2)
    rc = finish(start(cluster, tmp_path, script), tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 0, out[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4, summary
    assert nodes_seen(tmp_path / "run") == {"n0", "n1"}  # WANKA_NODE = SLURMD_NODENAME
    assert "rendezvous at n0:29500" in out
    assert not (tmp_path / "slurm" / "requeued").exists()


def _metrics_step(run: Path) -> int:
    try:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return 0
    return max((r.get("step", 0) for r in rows if "loss" in r), default=0)


def test_time_limit_warning_last_gasp_requeue_and_resume(cluster, tmp_path):
    steps = 20  # the warning comes at step 2: the stop must come from the signal
    script = write_script(tmp_path, steps=steps, every=1000)  # no periodic checkpoint
    run = tmp_path / "run"
    p = start(cluster, tmp_path, script)
    wait_for_step(p, tmp_path, 2, poll_s=0.2)
    p.send_signal(signal.SIGUSR1)  # Slurm: `--signal=B:USR1@...` before the time limit
    rc = finish(p, tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 75, out[-4000:]
    assert (tmp_path / "slurm" / "requeued").read_text().split() == [JOB_ID]
    # The only checkpoint is the last gasp's, at the step where the ranks stopped together.
    stopped_at = _metrics_step(run)
    assert 2 <= stopped_at < steps
    ckpts = [x.name for x in (run / "checkpoints").iterdir()]
    assert ckpts == [f"step-{stopped_at:08d}"], (ckpts, stopped_at)
    assert not (run / "summary.json").exists()

    # The requeued job: the same script, run again, resumes from the last gasp and finishes.
    # A requeued job may land on other nodes, whose /dev/shm holds none of this job's
    # in-memory snapshots: drop them, so the checkpoint on shared storage must serve.
    shutil.rmtree(tmp_path / "shm")
    rc = finish(start(cluster, tmp_path, script, restart=1), tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 0, out[-4000:]
    assert "job 4242 (restart 1)" in out
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    resumes = [(e["step"], e["source"]) for e in events if e["kind"] == "resume"]
    assert resumes == [(stopped_at, "disk")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2


def test_store_control_names_a_remote_crash_and_restarts_every_host(cluster, tmp_path):
    """resilience.control = store under Slurm: one supervisor per node, the one on n0 (the
    rendezvous host) coordinates. A rank killed on n1 is named there, with its node, by n0 from
    the control store; both nodes restart on its word and the job finishes. Heartbeats live in
    each node's own /dev/shm: none in the shared run directory."""
    steps = 40
    script = write_script(tmp_path, steps=steps, every=5,
                          extra=('resilience.control="store"',))  # fmt: skip
    run = tmp_path / "run"
    n1 = next(n for n in cluster.state.nodes if n.name == "n1")
    p = start(cluster, tmp_path, script, private_shm=True)
    hb = shm_of(n1) / "wanka-control" / f"{JOB_ID}.0" / "n1" / "attempt1"
    deadline = time.monotonic() + 180
    while _metrics_step(run) < 3 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    from wanka.resilience.heartbeat import read_all

    beats = read_all(hb)
    assert 1 in beats and p.poll() is None, (
        sorted(beats),
        (tmp_path / "slurm.out").read_text()[-4000:],
    )
    os.kill(beats[1].pid, signal.SIGKILL)  # rank 1, on n1
    rc = finish(p, tmp_path)
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 0, out[-4000:]
    assert "rank 1 on node n1: process_crash" in out, out[-4000:]
    assert "restart as the coordinator (n0) decided" in out, out[-4000:]
    faults = [e for e in map(json.loads, (run / "resilience" / "timeline.jsonl").read_text().splitlines())
              if e.get("kind") == "fault"]  # fmt: skip
    assert [(f["cause"], f["rank"], f["node"]) for f in faults] == [("process_crash", 1, "n1")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["world_size"] == 2
    assert not list((run / "resilience").glob("hb/rank*")), "heartbeats went through the run dir"
    assert not hb.parent.exists()  # each host clears its own folder at the end


def test_store_control_the_coordinators_host_lost_ends_the_others_within_the_limit(
    cluster, tmp_path
):
    """Every process of n0's task killed at once (its host went: the supervisor that
    coordinates, its ranks, the control store). n1 can no longer reach the store: within the
    agents' limit (10 s) it stops its ranks and ends, naming n0, instead of waiting for a
    decision that cannot come; Slurm requeues the job (a node failure) and it resumes."""
    script = write_script(tmp_path, steps=400, every=1000,
                          extra=('resilience.control="store"',))  # fmt: skip
    run = tmp_path / "run"
    p = start(cluster, tmp_path, script, private_shm=True)
    wait_for_step(p, tmp_path, 2)
    t_kill = time.monotonic()
    kill_node_task(tmp_path, 0)
    rc = finish(p, tmp_path, timeout=120)
    took = time.monotonic() - t_kill
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 128 + signal.SIGKILL, out[-4000:]  # srun: the highest task code, n0's
    assert "wanka train: node n0: node_lost (the control store at n0:29501 was unreachable" in out
    assert "n1: task 1: Exited with exit code 1" in out, out[-4000:]
    print(f"n1 ended {took:.1f} s after n0 was killed")
    assert took < 10 + 10, took  # the limit, plus the last failed call and the exit
    assert _metrics_step(run) < 400
