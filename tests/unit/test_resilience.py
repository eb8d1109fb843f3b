"""Heartbeats, learned time-outs, hang culprits, chaos schedules, checkpoint integrity, loss guard."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from wanka.resilience.chaos import WorkerChaos, damage_latest_checkpoint, parse_schedule
from wanka.resilience.heartbeat import (
    PHASE_ID,
    Beat,
    Reporter,
    exit_code,
    exit_message,
    mark_exit,
    read_all,
)
from wanka.resilience.monitor import HangMonitor, Timeouts, process_state, stragglers
from wanka.resilience.worker import LossGuard
from wanka.train.checkpoint import MARKER, complete_checkpoints, verify, write_manifest


def test_heartbeat_roundtrip_and_phase_maxima(tmp_path):
    rep = Reporter(tmp_path, rank=3, attempt=2)
    rep.enter("forward", step=7)
    time.sleep(0.05)
    rep.enter("backward")
    beats = read_all(tmp_path)
    b = beats[3]
    assert (b.pid, b.attempt, b.step, b.phase) == (os.getpid(), 2, 7, "backward")
    assert b.max_seconds["forward"] >= 0.05 and b.max_seconds["eval"] == 0.0
    (tmp_path / "rank4.hb").write_bytes(b"torn")  # a half-written file is skipped, not fatal
    assert set(read_all(tmp_path)) == {3}


def test_an_exit_mark_carries_the_reason_to_the_supervisor(tmp_path, monkeypatch):
    monkeypatch.setenv("WANKA_HB_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WANKA_SUPERVISED", raising=False)
    assert mark_exit(2, "bad value; fix it") is False  # plain torchrun: the rank prints it
    monkeypatch.setenv("WANKA_SUPERVISED", "1")
    assert mark_exit(2, "checkpoint of step 12 could not be written\nsecond line") is True
    assert exit_code(tmp_path, 3) == 2
    assert exit_message(tmp_path, 3) == "checkpoint of step 12 could not be written\nsecond line"
    assert mark_exit(1) is False and exit_code(tmp_path, 3) == 1  # no reason: nothing to say
    assert exit_message(tmp_path, 3) is None and exit_code(tmp_path, 4) is None
    assert [p.name for p in tmp_path.iterdir()] == ["rank3.exit"]  # no temporary left over


def test_timeouts_learn_floor_and_persist(tmp_path):
    t = Timeouts(tmp_path / "t.json", factor=3.0, floor=4.0, initial=120.0)
    assert t.limit("forward") == 120.0  # nothing seen yet: generous
    rep = Reporter(tmp_path / "hb", 0, 1)
    rep.max_seconds[PHASE_ID["forward"]] = 0.5  # forward took 0.5 s at most
    rep.max_seconds[PHASE_ID["backward"]] = 2.0  # backward 2 s
    rep.enter("data")
    t.observe(read_all(tmp_path / "hb").values())
    assert t.limit("forward") == 4.0  # 3 x 0.5 is below the floor
    assert t.limit("backward") == pytest.approx(6.0)
    t.save()
    again = Timeouts(tmp_path / "t.json", 3.0, 4.0, 120.0)  # a restart starts from what was learned
    assert again.limit("backward") == pytest.approx(6.0)


def test_hang_culprit_is_the_stopped_rank(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(sleeper.pid, signal.SIGSTOP)
        for _ in range(50):
            if process_state(sleeper.pid) == "T":
                break
            time.sleep(0.02)
        t = Timeouts(tmp_path / "t.json", 3.0, 1.0, 1.0)
        mon = HangMonitor(t)
        # rank 0 (this process, running) entered its phase earlier than the stopped rank 1:
        # the stopped one is still the culprit.
        now = time.time()
        beats = {0: Beat(0, os.getpid(), 1, 5, "forward", now - 10, now, {}),
                 1: Beat(1, sleeper.pid, 1, 5, "backward", now - 3, now, {})}  # fmt: skip
        hang = mon.check(beats, now)
        assert hang is not None and hang.rank == 1 and hang.state == "T"
        assert "SIGSTOP" in hang.describe()
        assert mon.check({0: beats[0]}, now - 9.5) is None  # within the limit: no hang
    finally:
        sleeper.kill()
        sleeper.wait()
    assert process_state(sleeper.pid) is None


def test_chaos_schedule_parsing_and_errors(tmp_path):
    fs = parse_schedule("kill@step=3,rank=1; stop@t=2.5 ;slow@step=4,rank=0,ms=50,steps=2")
    # Schedules name steps 1-based, like the progress bar; Fault.step is the 0-based index.
    assert [(f.kind, f.step, f.t, f.rank) for f in fs] == [("kill", 2, None, 1),
                                                            ("stop", None, 2.5, 0), ("slow", 3, None, 0)]  # fmt: skip
    assert fs[0].spec() == "kill@step=3,rank=1"  # round trip
    assert fs[2].params == {"ms": 50, "steps": 2}
    for bad, msg in [("explode@step=1", "unknown kind"), ("kill@rank=1", "say when"),
                     ("kill@step=x", "key=number")]:  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_schedule(bad)
    w = WorkerChaos("nan@step=2,rank=1,id=0;slow@step=4,rank=1,ms=50,steps=2,id=1", 1, tmp_path)
    assert not w.nan_now(0) and w.nan_now(1) and not w.nan_now(1)  # during step 2; once
    assert (tmp_path / "0.fired").exists()
    assert [w.delay(s) for s in (2, 3, 4, 5)] == [0.0, 0.05, 0.05, 0.0]
    with pytest.raises(ValueError, match="steps count from 1"):
        parse_schedule("kill@step=0")


def _fake_checkpoint(root, step, payload=b"x" * 4000):
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    (d / ".metadata").write_bytes(b"meta")
    write_manifest(d, step)
    return d


@pytest.mark.parametrize("damage", ["corrupt_ckpt", "truncate_ckpt"])
def test_integrity_detects_damage(tmp_path, damage):
    good = _fake_checkpoint(tmp_path, 1)
    newest = _fake_checkpoint(tmp_path, 2)
    assert verify(good) is None and verify(newest) is None
    assert json.loads((newest / MARKER).read_text())["files"]["__0_0.distcp"][0] == 4000
    assert damage_latest_checkpoint(tmp_path, damage)
    problem = verify(newest)
    assert problem is not None and (
        "truncated" in problem if damage == "truncate_ckpt" else "checksum" in problem
    )
    assert verify(good) is None
    assert complete_checkpoints(tmp_path)[-1] == newest  # still listed until latest_valid flags it


def test_latest_valid_skips_and_flags_damaged(tmp_path):
    from wanka.train.checkpoint import CORRUPT, Checkpointer

    _fake_checkpoint(tmp_path, 1)
    newest = _fake_checkpoint(tmp_path, 2)
    damage_latest_checkpoint(tmp_path, "corrupt_ckpt")
    ck = Checkpointer.__new__(Checkpointer)
    ck.root, ck.is_main, ck.skipped = tmp_path, True, []
    assert ck.latest_valid().name == "step-00000001"
    assert (newest / CORRUPT).is_file() and newest.exists()  # kept for inspection, never loaded
    assert len(ck.skipped) == 1 and "step-00000002" in ck.skipped[0]


def test_loss_guard():
    g = LossGuard(spike_factor=3.0, warmup=3)
    assert g.check(float("nan"), 1.0) and g.check(1.0, float("inf"))
    for _ in range(3):
        assert g.check(2.0, 1.0) is None
        g.accept(2.0)
    assert g.check(5.0, 1.0) is None and "spike" in g.check(7.0, 1.0)
    g2 = LossGuard(3.0, 3)
    g2.load_state_dict(g.state_dict())
    assert g2.check(7.0, 1.0) is not None


def test_young_daly_schedule():
    from wanka.train.checkpoint import SaveSchedule

    fixed = SaveSchedule(every=5, mtbf_s=100.0, start=0)
    assert [s for s in range(1, 16) if fixed.due(s)] == [5, 10, 15]
    auto = SaveSchedule(every=0, mtbf_s=200.0, start=3)
    assert not auto.due(12) and auto.due(13)  # an early save measures the cost
    auto.saved(13, save_s=1.0, step_s=0.5)  # sqrt(2 x 1 x 200) - 1 = 19 s = 38 steps
    assert auto.interval_steps == 38 and not auto.due(50) and auto.due(51)
    auto.saved(51, save_s=4.0, step_s=0.5)  # costlier saves -> rarer: sqrt(1600) - 4 = 36 s
    assert auto.interval_steps == 72


def test_straggler_in_data_loading_is_flagged_not_the_waiting_peers():
    now = time.time()
    fast = {"data": 0.01}
    beats = {0: Beat(0, 1, 1, 9, "sync", now - 0.8, now, fast),  # waits for rank 1
             1: Beat(1, 2, 1, 9, "data", now - 0.8, now, {"data": 0.8}),
             2: Beat(2, 3, 1, 9, "sync", now - 0.8, now, fast)}  # fmt: skip
    assert stragglers(beats, now) == [1]
    beats[1] = Beat(1, 2, 1, 9, "data", now - 0.2, now, {"data": 0.2})
    assert stragglers(beats, now) == []  # 20x the others but under the floor: jitter
    beats[1] = Beat(1, 2, 1, 9, "data", now - 0.4, now, {"data": 0.4})
    beats[0] = Beat(0, 1, 1, 9, "sync", now - 0.4, now, {"data": 0.1})
    assert stragglers(beats, now) == []  # over the floor but only 4x the slowest other


def test_learned_limit_follows_the_recent_pace(tmp_path):
    rep = Reporter(tmp_path / "hb", 0, 1)
    rep.max_seconds[PHASE_ID["forward"]] = 3.0  # a slow warm-up forward ...
    for _ in range(60):  # ... then 60 fast ones
        rep.enter("forward")
        rep.enter("backward")
    t = Timeouts(tmp_path / "t.json", factor=3.0, floor=0.5, initial=120.0)
    t.learned["forward"] = 3.0  # what an earlier attempt learned
    t.observe(read_all(tmp_path / "hb").values())
    assert t.learned["forward"] < 3.0 * 0.95**50  # forgotten, not kept forever
    assert t.limit("checkpoint") == 120.0  # never seen: generous


def test_agent_seen_crash_still_names_the_rank_that_died(tmp_path):
    """When the elastic agent reports a death before the monitor polls, the fault still names
    the rank that died (not the peers the agent ended with SIGTERM) and where it was."""
    from wanka.resilience.heartbeat import Reporter
    from wanka.resilience.supervisor import Outcome, _blame

    hb = tmp_path / "hb"
    for rank in (0, 1):
        Reporter(hb, rank, 2).enter("forward" if rank == 1 else "sync", 3)
    out = Outcome("process_crash", exits={0: -15, 1: -9})
    _blame(out, hb, attempt=2)
    assert out.rank == 1 and out.detail == "rank 1 died in forward of step 4"  # 1-based
    stale = Outcome("process_crash", exits={0: -15, 1: -9})
    _blame(stale, hb, attempt=3)  # heartbeats of an older attempt say nothing about this one
    assert stale.rank == 1 and stale.detail == "rank 1 died (exit code -9)"


@pytest.mark.parametrize(
    ("codes", "max_step", "cause"),
    [
        ([], 5, "success"),
        ([2, -15], 5, "user_error"),  # torchrun: a rank said why, its peers were ended
        ([2, 143], 5, "user_error"),  # node agents exit 128 + 15 when ended (store mode)
        ([2, 1, 143], 5, "user_error"),
        ([2, 139], 5, "process_crash"),  # SIGSEGV on another node is a crash of its own
        ([143], 5, "process_crash"),  # ended with nothing that says why
        ([75, 143], 5, "preempted"),
        ([1], -1, "startup_failure"),
        ([-9], 3, "process_crash"),
    ],
)
def test_cause_of_exit_codes_reads_agents_and_torchrun_alike(codes, max_step, cause):
    from wanka.resilience.supervisor import cause_of_codes

    assert cause_of_codes(codes, max_step) == cause


class _Timeline:
    def event(self, *a, **kw) -> None:
        pass


@pytest.mark.parametrize(
    ("schedule", "nodes", "killed"),
    [
        ("node_kill@step=2,node=1", {0: "n0", 1: "n0", 2: "n1", 3: "n1"}, {2, 3}),
        ("node_kill@step=2", {0: "n1", 1: "n0", 2: "n1", 3: "n0"}, {0, 2}),  # rank 0's node
        # Store mode: a rank whose node is unknown is never killed (it once meant "all").
        ("node_kill@step=2,node=0", {0: "n0", 1: None, 2: "n1", 3: "n1"}, {0}),
        ("node_kill@step=2", {0: None, 1: "n0", 2: "n1", 3: "n1"}, set()),  # waits for rank 0
    ],
)
def test_node_kill_hits_only_the_named_node(tmp_path, schedule, nodes, killed):
    from wanka.resilience.chaos import ChaosDriver

    procs = {r: subprocess.Popen(["sleep", "30"]) for r in nodes}
    try:
        beats = {r: Beat(r, p.pid, 0, 2, "forward", time.time(), time.time(), {})
                 for r, p in procs.items()}  # fmt: skip
        driver = ChaosDriver(parse_schedule(schedule), tmp_path, "job", str(tmp_path / "snap"),
                             _Timeline())  # fmt: skip
        driver.poll(beats, time.time(), 0, node_of=nodes.get)
        for p in procs.values():
            try:
                p.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        assert {r for r, p in procs.items() if p.poll() is not None} == killed
        assert bool(driver.fired) == bool(killed)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
