"""One job per run directory, as a user meets it: a second `wanka train` on a live job's run dir
is refused in one line, a killed job's lock is taken over, leftovers of a killed save and stale
in-memory snapshots are cleaned at start; `wanka clean` and `wanka nodes` show the snapshots."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from wanka.resilience.heartbeat import read_all
from wanka.resilience.monitor import process_state

from .helpers import REPO, small_job, wanka


def _one_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("n", ["0", "-2"])
def test_nproc_below_one_is_named(tmp_path, n):
    r = wanka("train", "--nproc", n, "--set", f'run.dir="{tmp_path / "r"}"', timeout=60)
    assert r.returncode == 2
    assert _one_line(r.stderr) == (f"wanka train: --nproc must be 1 or more (got {n}): the "
                                   "number of ranks to start on this node")  # fmt: skip
    assert not (tmp_path / "r").exists()


def _age(path, hours):
    t = time.time() - hours * 3600
    for p in [*path.rglob("*"), path]:
        os.utime(p, (t, t))


def _snapshot_folder(shm, job, run_dir, idle_h):
    from wanka.train.run_lock import write_owner

    (shm / job / "node" / "rank0").mkdir(parents=True)
    (shm / job / "node" / "rank0" / "slot0.x.bin").write_bytes(b"\1" * (1 << 20))
    write_owner(shm, job, run_dir)
    _age(shm / job, idle_h)
    return shm / job


def test_second_job_is_refused_and_a_killed_jobs_lock_is_taken_over(tmp_path):
    # One rank, supervised; no checkpoint or snapshot to resume, so the takeover run is short.
    args = [*small_job(tmp_path, "run")[:1], "--nproc", "1", *small_job(tmp_path, "run")[3:],
            "--set", "parallel.ep=1", "--set", 'resilience.preflight="off"',
            "--set", "checkpoint.every=1000", "--set", "resilience.snapshot_every=0"]  # fmt: skip
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "wanka.cli", "train", *args, "--set",
                              "train.steps=100000"], cwd=REPO, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.time() + 120
        while not (run / "resilience" / "hb" / "rank0.hb").exists():  # ranks are training
            assert first.poll() is None and time.time() < deadline, "first job did not start"
            time.sleep(0.2)
        [beat] = read_all(run / "resilience" / "hb").values()
        rank_pid = beat.pid
        # As if the live job were in the middle of writing a checkpoint.
        partial = run / "checkpoints" / ".partial-step-00000999"
        partial.mkdir(parents=True)
        job_id = (run / "resilience" / "job_id").read_text()

        second = wanka("train", *args, "--set", "train.steps=2", timeout=120)
        assert second.returncode == 2
        line = _one_line(second.stderr)
        assert re.fullmatch(rf"wanka train: {run} is in use by pid {first.pid} on host \S+ since "
                            r"\d\d:\d\d:\d\d \(wanka train .*\); stop that job or pick another "
                            r"run\.dir", line), line  # fmt: skip
        from wanka.train.run_lock import LOCK_NAME, read_holder

        holder = read_holder(run)
        assert holder.pid == first.pid and "train.steps=100000" in holder.command
        # The live job's files are untouched: heartbeats, its save in progress, its job id.
        assert (run / "resilience" / "hb" / "rank0.hb").exists() and partial.is_dir()
        assert (run / "resilience" / "job_id").read_text() == job_id
        assert first.poll() is None
        starts = [
            json.loads(x) for x in (run / "resilience" / "timeline.jsonl").read_text().splitlines()
        ]
        assert sum(e["kind"] == "job" and e["t1"] is None for e in starts) == 1
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the job and its ranks, as a lost machine would
        first.wait()
    shm = tmp_path / "shm"
    stale = _snapshot_folder(shm, "old-00000001", tmp_path / "old", idle_h=48)
    recent = _snapshot_folder(shm, "recent-00000002", tmp_path / "recent", idle_h=1)
    deadline = time.time() + 30
    while process_state(rank_pid) not in ("Z", "X", None):  # exiting: its files still open
        assert time.time() < deadline
        time.sleep(0.1)
    third = wanka("train", *args, "--set", "train.steps=2", timeout=240)
    assert third.returncode == 0, third.stderr[-3000:]
    assert re.search(rf"^wanka train: taking over {run} from pid {first.pid} on host \S+ "
                     r"\(started \d\d:\d\d:\d\d\): that process is gone$", third.stderr, re.M)  # fmt: skip
    assert not partial.exists() and not stale.exists() and recent.exists()
    assert f"removed {partial}: left by a checkpoint save that never finished" in third.stderr
    assert f"wanka train: removed stale snapshots {stale} (" in third.stderr
    assert not (run / LOCK_NAME).exists()  # released at the end


def test_clean_lists_and_removes_snapshots_of_jobs_not_running(tmp_path, capsys):
    from wanka.cli import main
    from wanka.resilience.ledger import FaultLedger
    from wanka.train.run_lock import RunLock

    shm = tmp_path / "shm"
    with RunLock(tmp_path / "live"):  # a live job holds its run dir
        live = _snapshot_folder(shm, "live-00000001", tmp_path / "live", idle_h=48)
        stale = _snapshot_folder(shm, "stale-00000002", tmp_path / "stale", idle_h=48)
        idle = _snapshot_folder(shm, "idle-00000003", tmp_path / "idle", idle_h=2)

        assert main(["clean", "--snapshot-dir", str(shm)]) == 0
        out = capsys.readouterr().out
        rows = {line.split()[0]: line.split() for line in out.splitlines()[2:-1]}
        assert {k: v[5] for k, v in rows.items()} == {
            "live-00000001": "live", "stale-00000002": "stale", "idle-00000003": "idle"}  # fmt: skip
        assert rows["stale-00000002"][6] == str((tmp_path / "stale").resolve())
        assert rows["stale-00000002"][1:5] == ["1.0", "MiB", "48.0", "h"]
        assert "`wanka clean --snapshots` removes the stale ones" in out and stale.exists()

        FaultLedger(str(tmp_path / "faults.sqlite"))  # `wanka nodes` wants an existing ledger
        assert main(["nodes", "--ledger", str(tmp_path / "faults.sqlite"),
                     "--snapshot-dir", str(shm)]) == 0  # fmt: skip
        out = capsys.readouterr().out
        assert (f"in-memory snapshots in {shm}: 3 job folder(s), 3.0 MiB; 1 live, 1 stale "
                "(idle > 24 h): `wanka clean --snapshots` frees 1.0 MiB") in out  # fmt: skip
        assert "stale-00000002" in out and "live-00000001" in out

        assert main(["clean", "--snapshot-dir", str(shm), "--snapshots"]) == 0
        out = capsys.readouterr().out
        assert f"removed {stale} (1.0 MiB)\nfreed 1.0 MiB in 1 folder(s)\n" in out
        assert not stale.exists() and idle.exists() and live.exists()

        assert main(["clean", "--snapshot-dir", str(shm), "--all"]) == 0
        out = capsys.readouterr().out
        assert f"removed {idle} (1.0 MiB)\nfreed 1.0 MiB in 1 folder(s)\n" in out
        assert not idle.exists() and live.exists()  # never a live job's
    assert main(["clean", "--snapshot-dir", str(tmp_path / "none")]) == 0
    assert capsys.readouterr().out == f"no in-memory snapshots in {tmp_path / 'none'}\n"


def test_every_checkpoint_damaged_says_one_line_and_keeps_them(tmp_path):
    """Needs trainer._resume to call Checkpointer.say_none_usable() (see docs/RESILIENCE.md)."""
    run = tmp_path / "run"
    args = [*small_job(tmp_path, "run")[:1], "--nproc", "1", *small_job(tmp_path, "run")[3:],
            "--set", "parallel.ep=1", "--set", 'resilience.preflight="off"',
            "--set", "resilience.supervise=false", "--set", "checkpoint.every=1",
            "--set", "train.steps=2"]  # fmt: skip
    r = wanka("train", *args, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (run / "loss_curve.png").is_file()  # no supervisor: rank 0 draws it
    for d in sorted((run / "checkpoints").glob("step-*")):  # every one damaged on disk
        data = next(d.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    r = wanka("train", *args, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [x for x in r.stderr.splitlines() if "usable checkpoint" in x or "skipping" in x]
    assert said == [f"no usable checkpoint in {run / 'checkpoints'} (2 damaged, kept for "
                    "inspection); starting from step 0"], r.stderr[-3000:]  # fmt: skip
    # Saved again from scratch: each damaged checkpoint was set aside first, never overwritten.
    for step in (1, 2):
        [aside] = (run / "checkpoints").glob(f"step-{step:08d}.corrupt-*")
        assert (aside / "CORRUPT").is_file()
        assert f"was flagged corrupt; moved to {aside.name} (kept for inspection)" in r.stderr
        assert (run / "checkpoints" / f"step-{step:08d}" / "COMPLETE").is_file()


def test_job_stopped_before_its_ranks_leaves_no_snapshot_folder(tmp_path):
    r = wanka("train", "configs/demo.toml", "--nproc", "1", "--set", "parallel.ep=1",
              "--set", 'checkpoint.load="/nonexistent/step-00000001"',
              "--set", f'run.dir="{tmp_path / "run"}"',
              "--set", f'resilience.snapshot_dir="{tmp_path / "shm"}"',
              "--set", f'resilience.ledger="{tmp_path / "faults.sqlite"}"', timeout=120)  # fmt: skip
    assert r.returncode == 2 and "pre-flight checkpoint" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "shm").exists() or list((tmp_path / "shm").iterdir()) == []
    assert not (tmp_path / "run" / "wanka.lock").exists()


def test_clean_also_reaches_each_cluster_nodes_own_memory(tmp_path, capsys):
    """On the cluster-in-a-box a node's /dev/shm is its own folder on the host: `wanka clean
    --cluster-state DIR` lists and sweeps it too, each line saying whose memory it is."""
    import uuid

    from wanka.cli import main
    from wanka.cluster.state import ClusterState, Node, save

    inside = f"/dev/shm/wanka-cleantest-{uuid.uuid4().hex[:8]}"  # what the nodes call it
    nodes = [Node(f"n{i}", f"ns{i}", f"h{i}", f"v{i}", f"10.9.0.{i}", root=str(tmp_path / f"n{i}"))
             for i in range(2)]  # fmt: skip
    save(ClusterState("t", "10.9.0.0/24", "br", 1.0, None, nodes), tmp_path / "state")
    shm1 = tmp_path / "n1" / "shm" / inside.removeprefix("/dev/shm/")
    stale = _snapshot_folder(shm1, "stale-00000002", tmp_path / "gone", idle_h=48)
    args = ["clean", "--snapshot-dir", inside, "--cluster-state", str(tmp_path / "state")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"no in-memory snapshots in {inside}\n" in out  # the host's own: none
    assert f"node n1: in-memory snapshots in {shm1} (stale" in out and "stale-00000002" in out
    assert main([*args, "--snapshots"]) == 0
    out = capsys.readouterr().out
    assert f"removed {stale} (1.0 MiB)\nnode n1: freed 1.0 MiB in 1 folder(s)" in out
    assert not stale.exists()


def test_a_stop_request_as_the_job_starts_is_one_line_and_frees_the_lock(tmp_path):
    """SIGTERM once the lock is taken, before the supervisor's own handlers (imports and the
    pre-flight take seconds): it killed `wanka train` silently (exit 143), lock left behind."""
    args = [*small_job(tmp_path, "run")[:1], "--nproc", "1", *small_job(tmp_path, "run")[3:],
            "--set", "parallel.ep=1"]  # fmt: skip
    lock = tmp_path / "run" / "wanka.lock"
    p = subprocess.Popen([sys.executable, "-m", "wanka.cli", "train", *args], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.time() + 120
        # The record is written just before the handlers go in (microseconds later).
        while (
            p.poll() is None
            and time.time() < deadline
            and not (lock.exists() and lock.stat().st_size)
        ):
            time.sleep(0.01)
        time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 75, err[-3000:]
    assert "stopped on request (SIGTERM) before the job started" in _one_line(err)
    assert not lock.exists()
