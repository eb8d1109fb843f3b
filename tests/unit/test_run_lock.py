"""Run-directory safety: the run lock, its stale-lock rules, snapshot folder ownership and sweep
(checkpoint leftovers: test_checkpoint_leftovers.py)."""

import json
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from wanka.train import run_lock
from wanka.train.run_lock import (
    LOCK_NAME,
    OWNER,
    RunDirBusy,
    RunLock,
    pid_start,
    read_holder,
    rendezvous_key,
    snapshot_folders,
    sweep_snapshots,
    write_owner,
)

BUSY = re.compile(r"^(\S+) is in use by pid (\d+) on host (\S+) since (\d\d:\d\d:\d\d) \((.*)\); "
                  r"stop that job or pick another run\.dir$")  # fmt: skip


def _fake_lock(run_dir, *, host=None, pid=None, start="auto", age_s=0.0, job=None, boot=None):
    """A lock file as another `wanka train` would have left it (not flock()ed by anyone)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    pid = os.getppid() if pid is None else pid
    rec = {"host": host or socket.gethostname(), "boot_id": boot or run_lock._boot_id(),
           "pid": pid, "pid_start": pid_start(pid) if start == "auto" else start,
           "started": time.time() - age_s, "command": "wanka train other.toml", "job": job}  # fmt: skip
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps(rec))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lock_records_the_holder_and_refuses_a_second_job(tmp_path):
    run = tmp_path / "runs" / "x"
    with RunLock(run, "wanka train a.toml", shown="runs/x") as lock:
        assert lock.held and lock.taken_over is None
        h = read_holder(run)
        assert (h.host, h.pid, h.command) == (
            socket.gethostname(),
            os.getpid(),
            "wanka train a.toml",
        )
        assert h.pid_start == pid_start(os.getpid()) and abs(h.started - time.time()) < 60
        with pytest.raises(RunDirBusy) as e:  # another open file: flock() says no
            RunLock(run, "wanka train b.toml", shown="runs/x").acquire()
        m = BUSY.match(str(e.value))
        assert m and m[1] == "runs/x" and int(m[2]) == os.getpid() and m[5] == "wanka train a.toml"
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
    assert not (run / LOCK_NAME).exists()
    assert not run.exists()  # made only for the lock, nothing else ran: removed again


def _race(run, barrier, results):
    barrier.wait()
    try:
        lock = RunLock(run, f"racer {os.getpid()}").acquire()
        results.put("won")
        time.sleep(1.0)  # hold while the others try
        lock.release()
    except RunDirBusy:
        results.put("refused")


def test_racing_starts_cannot_both_win(tmp_path):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path / "run", barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    got = sorted(results.get(timeout=5) for _ in procs)
    assert got == ["refused", "refused", "refused", "won"]


def test_stale_lock_on_this_host_is_taken_over(tmp_path):
    dead = _dead_pid()
    _fake_lock(tmp_path, pid=dead, start=123)
    with RunLock(tmp_path, "wanka train") as lock:
        assert lock.held and re.fullmatch(
            rf"taking over {tmp_path} from pid {dead} on host \S+ \(started \d\d:\d\d:\d\d\): "
            r"that process is gone", lock.taken_over)  # fmt: skip
        assert read_holder(tmp_path).pid == os.getpid()


def test_reused_pid_is_taken_over_and_a_live_one_is_not(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _fake_lock(tmp_path, pid=sleeper.pid, start=pid_start(sleeper.pid) + 1)
        with RunLock(tmp_path) as lock:
            assert "its PID now belongs to another process" in lock.taken_over
        # Alive with the recorded start time, where flock() gives no answer: live.
        _fake_lock(tmp_path, pid=sleeper.pid)
        with pytest.MonkeyPatch.context() as mp_:
            mp_.setattr(run_lock, "_flock", lambda fd: None)
            with pytest.raises(RunDirBusy, match=f"in use by pid {sleeper.pid} on host"):
                RunLock(tmp_path).acquire()
        # Where flock() works, a live job on this host holds it: a record nobody holds is a
        # copy of a live run's directory (it was refused as in use by that job).
        _fake_lock(tmp_path, pid=sleeper.pid)
        with RunLock(tmp_path) as lock:
            assert f"from pid {sleeper.pid}" in lock.taken_over
            assert "no process holds its lock" in lock.taken_over
    finally:
        sleeper.kill()
        sleeper.wait()


def test_other_host_is_live_until_its_lock_goes_unrefreshed(tmp_path):
    _fake_lock(tmp_path, host="elsewhere", pid=1, boot="other-boot", age_s=run_lock.STALE_S - 30)
    with pytest.raises(RunDirBusy, match="in use by pid 1 on host elsewhere"):
        RunLock(tmp_path).acquire()
    _fake_lock(tmp_path, host="elsewhere", pid=1, boot="other-boot", age_s=run_lock.STALE_S + 30)
    with RunLock(tmp_path) as lock:
        assert "from pid 1 on host elsewhere" in lock.taken_over
        assert (
            "last refreshed" in lock.taken_over
            and f"limit {run_lock.STALE_S:.0f} s" in lock.taken_over
        )


def test_holder_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "REFRESH_S", 0.05)
    with RunLock(tmp_path):
        old = time.time() - 1000
        os.utime(tmp_path / LOCK_NAME, (old, old))
        time.sleep(0.5)
        assert (tmp_path / LOCK_NAME).stat().st_mtime > old + 900


def test_nodes_of_one_multinode_job_share_the_run_dir(tmp_path):
    key = rendezvous_key({"nnodes": "2", "rdzv_id": "j1", "rdzv_endpoint": "h0:29400",
                          "node_rank": "0"})  # fmt: skip
    assert key == rendezvous_key({"nnodes": "2", "rdzv_id": "j1", "rdzv_endpoint": "h0:29400",
                                  "node_rank": "1"})  # fmt: skip
    assert rendezvous_key({"nnodes": None}) is None and rendezvous_key({"nnodes": "1:1"}) is None
    other = rendezvous_key({"nnodes": "2", "rdzv_id": "j2", "rdzv_endpoint": "h0:29400"})
    with RunLock(tmp_path, "node 0", key) as holder:
        assert holder.held
        with RunLock(tmp_path, "node 1", key) as peer:  # same rendezvous: joins, takes nothing
            assert not peer.held and peer.peer_of.pid == os.getpid()
        with pytest.raises(RunDirBusy):
            RunLock(tmp_path, "another job", other).acquire()
        with pytest.raises(RunDirBusy):
            RunLock(tmp_path, "a single-node job").acquire()
        assert read_holder(tmp_path).command == "node 0"  # the peer left the lock alone


# -- snapshot folders -----------------------------------------------------------------------------
def _folder(root, job, run_dir=None, idle_h=0.0, mb=1):
    d = root / job / "node" / "rank0"
    d.mkdir(parents=True)
    (d / "slot0.sig.bin").write_bytes(b"\0" * (mb << 20))
    if run_dir is not None:
        write_owner(root, job, run_dir)
    t = time.time() - idle_h * 3600
    for p in [*sorted((root / job).rglob("*")), root / job]:
        os.utime(p, (t, t))
    return root / job


def test_sweep_removes_only_stale_folders(tmp_path):
    shm = tmp_path / "shm"
    live_run = tmp_path / "live"
    with RunLock(live_run):
        stale = _folder(shm, "gone-1", tmp_path / "gone", idle_h=30)
        orphan = _folder(shm, "nobody-2", None, idle_h=30)  # no owner record: not wanka's
        live = _folder(shm, "live-3", live_run, idle_h=30)  # its run dir is locked: never
        current = _folder(shm, "cur-4", tmp_path / "cur", idle_h=30)
        fresh = _folder(shm, "fresh-5", tmp_path / "fresh", idle_h=1)
        by_name = {f.path.name: f for f in snapshot_folders(shm)}
        assert by_name["live-3"].live and not by_name["gone-1"].live
        assert by_name["gone-1"].run_dir == str((tmp_path / "gone").resolve())
        assert by_name["gone-1"].bytes >= 1 << 20 and 29 * 3600 < by_name["gone-1"].idle_s
        assert [f.state(24) for f in by_name.values()] == [
            "stale",
            "idle",
            "stale",
            "live",
            "other",
        ]
        assert sweep_snapshots(shm, 0, "cur-4") == []  # 0: never
        removed = sweep_snapshots(shm, 24, current="cur-4")
        assert sorted(f.path.name for f in removed) == ["gone-1"]
        assert not stale.exists()
        assert live.exists() and current.exists() and fresh.exists() and orphan.exists()
    assert sweep_snapshots(tmp_path / "absent", 24) == []


def test_sweep_leaves_what_is_not_a_wanka_snapshot_folder(tmp_path):
    """resilience.snapshot_dir pointed at a folder of other things (runs/, a home folder): old
    folders there without wanka's owner record, or with one naming another folder, stay."""
    shm = tmp_path / "runs"
    thesis = shm / "thesis" / "chapters"
    thesis.mkdir(parents=True)
    (thesis / "ch1.tex").write_text("years of work")
    copied = _folder(shm, "old_run", tmp_path / "old", idle_h=48)
    os.rename(copied, shm / "renamed")  # its record names the job "old_run", not this folder
    t = time.time() - 48 * 3600
    for p in [*sorted(shm.rglob("*"))]:
        os.utime(p, (t, t))
    assert sweep_snapshots(shm, 24) == []
    assert (thesis / "ch1.tex").read_text() == "years of work" and (shm / "renamed").is_dir()
    assert {f.state(24) for f in snapshot_folders(shm)} == {"other"}


def test_finished_job_leaves_no_snapshot_folder(tmp_path):
    from wanka.resilience.snapshot import SnapshotStore

    write_owner(tmp_path, "job", tmp_path / "run")
    store = SnapshotStore(tmp_path, "job", "n0", 0, 1, 1, replica=False, signature="s")
    store.save(1, {"w": torch.zeros(10)})
    assert (tmp_path / "job" / OWNER).is_file()
    store.close(discard=True)
    assert list(tmp_path.iterdir()) == []  # the owner record went with the last rank


def test_ranks_write_the_owner_record_where_their_node_has_none(tmp_path):
    """On another host (a node whose /dev/shm is its own) the supervisor's record is absent: the
    snapshot store writes one, so the sweep and `wanka clean` know the folder's run directory.
    It never replaces the supervisor's."""
    from wanka.resilience.snapshot import SnapshotStore

    shm, run = tmp_path / "shm", tmp_path / "run"
    store = SnapshotStore(shm, "job1", "n1", 0, 1, 1, True, "sig", run_dir=run)
    store.close(discard=False)
    [folder] = snapshot_folders(shm)
    assert folder.run_dir == str(run.resolve())
    write_owner(shm, "job2", tmp_path / "elsewhere")
    SnapshotStore(shm, "job2", "n1", 0, 1, 1, True, "sig", run_dir=run).close(discard=False)
    assert json.loads((shm / "job2" / "job.json").read_text())["run_dir"].endswith("elsewhere")


def test_the_sweep_reaches_into_each_cluster_nodes_own_memory(tmp_path):
    """On the cluster-in-a-box each node's /dev/shm is its own (host folder ROOT/shm): the
    start-of-job sweep looks there too, removing only stale folders, never the current job's."""
    from wanka.cluster.nodes import node_path, sweep_node_snapshots
    from wanka.cluster.state import ClusterState, Node

    nodes = [Node(f"n{i}", f"ns{i}", f"h{i}", f"v{i}", f"10.0.0.{i}", str(tmp_path / f"n{i}"))
             for i in range(2)]  # fmt: skip
    st = ClusterState("wk", "10.0.0.0/24", "br", 1.0, None, nodes)
    assert node_path(nodes[1], "/dev/shm/wanka") == tmp_path / "n1" / "shm" / "wanka"
    assert node_path(Node("x", "ns", "h", "v", "a"), "/dev/shm/wanka") is None  # shared memory
    old = time.time() - 3 * 3600
    for job in ("stale", "current"):
        d = tmp_path / "n1" / "shm" / "wanka" / job / "n1" / "rank1"
        d.mkdir(parents=True)
        (d / "slot0.bin").write_bytes(b"x" * 10)
        write_owner(d.parent.parent.parent, job, tmp_path / "run")  # as the ranks' store does
        for p in [d / "slot0.bin", d.parent.parent / OWNER, d, d.parent, d.parent.parent]:
            os.utime(p, (old, old))
    said = sweep_node_snapshots(st, "/dev/shm/wanka", 1.0, "current")
    assert len(said) == 1 and "node n1" in said[0] and "stale" in said[0]
    assert sorted(p.name for p in (tmp_path / "n1" / "shm" / "wanka").iterdir()) == ["current"]
    assert sweep_node_snapshots(st, "/dev/shm/wanka", 0, None) == []  # 0: never
