"""The disk_full fault: schedule, safety cap, ballast, and checkpoints written onto a full disk.

Tests that fill a disk do it on a small tmpfs of their own (root on Linux); they skip, saying
why, where one cannot be mounted. Nothing here ever fills the machine's disk: the cap check
refuses it first.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from wanka.resilience.chaos import (
    BALLAST,
    FILL_CAP_ENV,
    GIB,
    MIB,
    ChaosDriver,
    check_fill_allowed,
    fill_cap_bytes,
    fill_disk,
    parse_schedule,
    small_filesystem,
    tmpfs_unavailable,
)
from wanka.resilience.drill import injected_faults
from wanka.resilience.heartbeat import Beat
from wanka.train.checkpoint import (
    Checkpointer,
    CheckpointWriteError,
    SaveSchedule,
    complete_checkpoints,
    verify,
    write_failure,
)

NO_TMPFS = tmpfs_unavailable()
needs_tmpfs = pytest.mark.skipif(NO_TMPFS is not None, reason=f"no tmpfs: {NO_TMPFS}")


class Timeline:
    """Stands in for TimelineWriter / Runtime.event: keeps the events."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def event(self, kind: str, t0: float, t1: float | None = None, **extra) -> None:
        self.events.append({"kind": kind, "t0": t0, "t1": t1, **extra})


def beats(step: int) -> dict[int, Beat]:
    now = time.time()
    return {r: Beat(r, os.getpid(), 1, step, "forward", now, now, {}) for r in (0, 1)}


def ballasts(root: Path) -> list[Path]:
    return sorted(root.glob(BALLAST + "*"))


# -- schedule and safety cap ------------------------------------------------------------------


def test_disk_full_schedule():
    a, b = parse_schedule("disk_full@step=5,for=2.5,keep_mb=3; disk_full@t=1.5,steps=4")
    assert (a.kind, a.step, a.params) == ("disk_full", 4, {"for": 2.5, "keep_mb": 3})  # 0-based
    assert (b.t, b.params) == (1.5, {"steps": 4})
    assert a.rank is None  # the disk is shared by every rank
    assert parse_schedule(a.spec())[0].params == a.params  # the spec reads back the same
    assert parse_schedule("disk_full@step=1,max_gb=0.5")[0].params == {"max_gb": 0.5}
    assert parse_schedule("slow@step=4,ms=50")[0].params == {"ms": 50}  # others stay integers


@pytest.mark.parametrize(
    "bad, msg",
    [
        ("disk_full@step=3,fro=10", "unknown parameter 'fro'"),
        ("disk_full@step=3,rank=1", "unknown parameter 'rank'"),
        ("disk_full@step=3,for=5,steps=2", "not both"),
        ("disk_full@step=3,for=0", "for must be > 0"),
        ("disk_full@step=3,steps=-1", "steps must be > 0"),
        ("disk_full@step=3,keep_mb=-1", "keep_mb must be >= 0"),
        ("disk_full@step=3,max_gb=0", "max_gb must be > 0"),
        ("disk_full@for=3", "say when"),
        ("disk_full@step=3,keep_mb=1.5", "keep_mb must be a whole number"),
    ],
)
def test_disk_full_schedule_errors(bad, msg):
    with pytest.raises(ValueError, match=msg) as e:
        parse_schedule(bad)
    assert "\n" not in str(e.value)


def test_fill_cap(monkeypatch, tmp_path):
    monkeypatch.delenv(FILL_CAP_ENV, raising=False)
    assert fill_cap_bytes() == 4 * GIB
    monkeypatch.setenv(FILL_CAP_ENV, "0.5")
    assert fill_cap_bytes() == GIB // 2
    assert fill_cap_bytes(parse_schedule("disk_full@step=1,max_gb=2")[0]) == 2 * GIB  # fault wins
    monkeypatch.setenv(FILL_CAP_ENV, "lots")
    with pytest.raises(ValueError, match=f"{FILL_CAP_ENV}='lots' must be a number"):
        fill_cap_bytes()
    # Any real filesystem is larger than one byte: refused, naming both ways out.
    with pytest.raises(ValueError, match="safety cap") as e:
        check_fill_allowed(tmp_path / "not" / "yet" / "made", cap_bytes=1)
    assert "--ckpt-fs-mb" in str(e.value) and FILL_CAP_ENV in str(e.value)
    check_fill_allowed(tmp_path, cap_bytes=1 << 62)  # under the cap: allowed


def test_driver_refuses_a_large_disk_before_the_job_starts(monkeypatch, tmp_path):
    monkeypatch.setenv(FILL_CAP_ENV, str(1 / GIB))  # one byte: the test machine's disk is larger
    faults = parse_schedule("kill@step=1;disk_full@step=3")
    with pytest.raises(ValueError, match="safety cap"):
        ChaosDriver(faults, tmp_path / "run", "job", str(tmp_path / "shm"), Timeline())
    # Without a disk_full fault the same driver is fine, and nothing was created.
    ChaosDriver(faults[:1], tmp_path / "run", "job", str(tmp_path / "shm"), Timeline())
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- the ballast, on a small tmpfs ------------------------------------------------------------


@needs_tmpfs
def test_driver_fills_then_releases_after_for_seconds(tmp_path, capsys):
    run = tmp_path / "run"
    with small_filesystem(run / "checkpoints", 16) as ckpts:
        (ckpts / f"{BALLAST}-9").write_bytes(b"x")  # left by a supervisor killed mid-drill
        tl = Timeline()
        driver = ChaosDriver(parse_schedule("disk_full@step=3,for=0.4,keep_mb=2"), run, "job",
                             str(tmp_path / "shm"), tl)  # fmt: skip
        assert ballasts(ckpts) == []  # swept at start
        driver.poll(beats(1), time.time(), 1)
        assert ballasts(ckpts) == [] and tl.events == []  # not yet
        t_fill = time.time()
        driver.poll(beats(2), t_fill, 1)
        free = shutil.disk_usage(ckpts).free
        assert 1.5 * MIB <= free <= 2.5 * MIB  # full but for keep_mb
        with pytest.raises(OSError):
            with open(ckpts / "more", "wb") as f:
                f.write(bytes(4 * MIB))
        (ckpts / "more").unlink()
        [ev] = tl.events
        assert ev["kind"] == "chaos" and ev["fault"].startswith("disk_full@step=3")
        assert (run / "resilience" / "chaos" / "0.fired").is_file()
        driver.poll(beats(3), t_fill + 0.2, 1)
        assert ballasts(ckpts)  # still full within for=
        driver.poll(beats(3), t_fill + 0.5, 1)
        assert ballasts(ckpts) == [] and shutil.disk_usage(ckpts).free > 15 * MIB
        released = tl.events[1]  # the fill's window, for the report
        assert released["released"] and released["fault"] == ev["fault"]
        assert abs(released["t0"] - ev["t0"]) < 1.0 and released["t1"] >= released["t0"]
        driver.poll(beats(9), time.time() + 60, 1)
        assert ballasts(ckpts) == [] and len(tl.events) == 2  # fires once, released once
        # A resubmitted job (new supervisor, same run) does not fill again.
        again = ChaosDriver(parse_schedule("disk_full@step=3,for=0.4,keep_mb=2"), run, "job",
                            str(tmp_path / "shm"), Timeline())  # fmt: skip
        again.poll(beats(5), time.time(), 2)
        assert ballasts(ckpts) == []
    assert "removed, the disk has room again" in capsys.readouterr().err


@needs_tmpfs
def test_driver_releases_after_steps_and_on_close(tmp_path):
    run = tmp_path / "run"
    with small_filesystem(run / "checkpoints", 16) as ckpts:
        driver = ChaosDriver(parse_schedule("disk_full@step=3,steps=3;disk_full@step=5"), run,
                             "job", str(tmp_path / "shm"), Timeline())  # fmt: skip
        driver.poll(beats(3), time.time(), 1)  # seen late: still counted from step 2
        assert len(ballasts(ckpts)) == 1 and shutil.disk_usage(ckpts).free < MIB
        driver.poll(beats(4), time.time(), 1)  # the second fault fills what little is left
        assert len(ballasts(ckpts)) == 2
        driver.poll(beats(5), time.time(), 1)  # 2 + 3: the first goes, the second stays (30 s)
        assert [p.name for p in ballasts(ckpts)] == [f"{BALLAST}-1"]
        driver.close()  # the supervisor is done (also registered with atexit)
        assert ballasts(ckpts) == []


@needs_tmpfs
def test_fill_refused_at_injection_is_reported_once(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    with small_filesystem(run / "checkpoints", 16) as ckpts:
        tl = Timeline()
        driver = ChaosDriver(parse_schedule("disk_full@step=1"), run, "job", str(tmp_path / "shm"),
                             tl)  # fmt: skip
        monkeypatch.setenv(FILL_CAP_ENV, str(1 / GIB))  # the cap changed under the job
        driver.poll(beats(1), time.time(), 1)
        driver.poll(beats(2), time.time(), 1)
        assert ballasts(ckpts) == [] and tl.events == []  # not injected, not recorded
        err = capsys.readouterr().err
        assert err.count("not injected") == 1 and "safety cap" in err


# -- checkpoints onto a full disk (a real DCP save, one gloo rank in this process) -------------


@pytest.fixture
def gloo():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@needs_tmpfs
@pytest.mark.parametrize("async_save", [False, True])
def test_save_onto_a_full_disk_is_skipped_then_works_again(gloo, tmp_path, async_save):
    model = torch.nn.Linear(256, 256)  # ~0.8 MB per checkpoint with both Adam moments
    opt = torch.optim.AdamW(model.parameters())
    with small_filesystem(tmp_path / "checkpoints", 8) as root:
        ck = Checkpointer(root, model, opt, keep=2, async_save=async_save, is_main=True)

        def save(step: int, must_succeed: bool):
            out = ck.save(step, {"note": step}, must_succeed=must_succeed)
            ck.wait()  # an async write fails here, under the rule of its save()
            return out

        _train(model, opt)
        assert save(1, must_succeed=False) is not None
        fill_disk(root, 0, 1 << 62)
        _train(model, opt)  # training goes on
        out = save(2, must_succeed=False)
        assert out is None if not async_save else out is not None  # async: failed in wait()
        [err] = ck.failures
        assert err.step == 2 and "No space left on device" in err.reason
        assert ck.failed_in_a_row == 1
        assert [p.name for p in root.iterdir() if p.name.startswith(".partial")] == []
        assert [p.name for p in complete_checkpoints(root)] == ["step-00000001"]
        assert verify(root / "step-00000001") is None  # the older checkpoint is untouched
        assert ck.latest_valid().name == "step-00000001"

        tl = Timeline()
        span: dict = {}
        with ck.report(tl.event, "n0", span):
            pass
        [ev] = tl.events
        assert ev["kind"] == "fault" and ev["cause"] == "checkpoint_write_failed"
        assert "No space left on device" in ev["detail"] and ev["step"] == 2
        assert ev["t0"] <= ev["t1"] and "not written" in span["error"] and ck.failures == []

        # The last checkpoint must be written: it raises, in one line, and is still reported.
        with pytest.raises(CheckpointWriteError, match="step 3 could not be written") as e:
            with ck.report(tl.event, "n0"):
                save(3, must_succeed=True)
        assert isinstance(e.value, ValueError) and "\n" not in str(e.value)
        assert "No space left on device" in str(e.value) and "free space" in str(e.value)
        assert len(tl.events) == 2 and ck.failed_in_a_row == 2
        assert not any(p.name.startswith(".partial") for p in root.iterdir())

        for p in root.glob(BALLAST + "*"):  # the operator frees space
            p.unlink()
        _train(model, opt)
        assert save(4, must_succeed=False) is not None
        assert ck.failed_in_a_row == 0 and ck.failures == []
        assert [p.name for p in complete_checkpoints(root)] == ["step-00000001", "step-00000004"]
        assert ck.holds(4) and not ck.holds(2)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.zero_()
        state = ck.load(ck.latest_valid(), {"note": 0})
        assert state["step"] == 4 and state["note"] == 4
        assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def _one_rank_cannot_write(root: str) -> None:
    """On 2 ranks: rank 1's data write fails, then rank 0's manifest, then nothing."""
    import errno
    import json

    import torch.distributed.checkpoint.filesystem as fs

    import wanka.train.checkpoint as ckpt_mod

    def broken(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer(Path(root), model, torch.optim.AdamW(model.parameters()), keep=2,
                      async_save=False, is_main=rank == 0)  # fmt: skip
    outcomes = []
    for step, module, name in [(1, fs, "_write_item"), (2, ckpt_mod, "write_manifest"),
                               (3, None, None)]:  # fmt: skip
        real = getattr(module, name) if module else None
        if module and rank == 2 - step:  # step 1: only rank 1 fails; step 2: only rank 0
            setattr(module, name, broken)
        try:
            outcomes.append(ck.save(step, {}, must_succeed=False) is not None)
        finally:
            if module:
                setattr(module, name, real)
    reasons = [e.reason for e in ck.failures]
    (Path(root) / f"rank{rank}.json").write_text(json.dumps([outcomes, reasons]))
    dist.destroy_process_group()


def test_every_rank_sees_the_failure_of_one(tmp_path):
    import json

    from tests.distributed.helpers import spawn

    spawn(2, _one_rank_cannot_write, str(tmp_path))
    for rank in (0, 1):
        outcomes, reasons = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcomes == [False, False, True]  # the same on both ranks, and nobody hung
        assert reasons == ["No space left on device"] * 2
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000003"]
    assert not any(p.name.startswith(".partial") for p in tmp_path.iterdir())


def test_write_failure_tells_disk_errors_from_bugs(tmp_path):
    import errno

    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert write_failure(enospc, tmp_path) == "No space left on device"
    summary = traceback.StackSummary()
    wrapped = CheckpointException("write", {1: (RuntimeError("x"), summary)})
    wrapped.failures[1][0].__context__ = enospc  # as raised while handling the OSError
    assert write_failure(wrapped, tmp_path) == "No space left on device"
    # A write step that failed with room to spare: its own last line.
    odd = CheckpointException("write", {0: (RuntimeError("disk went away"), summary)})
    assert write_failure(odd, tmp_path) == "RuntimeError: disk went away"
    # Planning failures and ordinary errors are bugs: they must surface as themselves.
    assert (
        write_failure(CheckpointException("plan", {0: (KeyError("w"), summary)}), tmp_path) is None
    )
    assert write_failure(RuntimeError("shape mismatch"), tmp_path) is None


@needs_tmpfs
def test_write_failure_without_an_oserror_asks_the_disk(tmp_path):
    # torch.save's zip writer can report ENOSPC as "unexpected pos N vs M", losing the OSError.
    pos = CheckpointException("write", {0: (RuntimeError("unexpected pos 704 vs 598"),
                                            traceback.StackSummary())})  # fmt: skip
    with small_filesystem(tmp_path / "ck", 4) as root:
        assert write_failure(pos, root) == "RuntimeError: unexpected pos 704 vs 598"
        fill_disk(root, 0, 1 << 62)
        why = write_failure(pos, root)
        assert why.startswith("No space left on device (0 KiB free") and "unexpected pos" in why


def test_a_failed_save_keeps_the_planned_interval():
    fixed = SaveSchedule(every=5, mtbf_s=100.0, start=0)
    fixed.failed(5)
    assert [s for s in range(6, 16) if fixed.due(s)] == [10, 15]
    auto = SaveSchedule(every=0, mtbf_s=200.0, start=0)
    auto.failed(10)  # the first save (which measures the cost) failed: try one distance later
    assert not auto.due(19) and auto.due(20)
    auto.saved(20, save_s=1.0, step_s=0.5)  # 38 steps
    auto.failed(58)
    assert not auto.due(95) and auto.due(96)  # not every step: one interval on


@needs_tmpfs
def test_preflight_fails_on_a_full_checkpoint_disk(tmp_path):
    from wanka.config import load_config
    from wanka.resilience.preflight import static_checks

    cfg = load_config(None, [f'run.dir="{tmp_path / "run"}"', "checkpoint.keep=1",
                             f'data.path="{tmp_path / "no-data"}"',
                             f'resilience.snapshot_dir="{tmp_path / "shm"}"'])  # fmt: skip
    with small_filesystem(tmp_path / "run" / "checkpoints", 64) as root:

        def check():
            return next(r for r in static_checks(cfg, 2) if r.name == "checkpoint")

        assert check().ok  # 2 x 22 MiB fit in 64
        fill_disk(root, 0, 1 << 62)
        r = check()
        assert not r.ok and "0 KiB free" in r.message and "free disk space" in r.message


def test_disk_full_rows_of_the_drill_table(tmp_path):
    # Steps of about 1 s; the disk filled at 2.05; a kill at 3.0, detected at 3.2; the save
    # after step 4 fails at 5.4: the disk_full row looks past the kill for its cause.
    ev = [{"kind": "job", "t0": 0.0, "t1": 12.0}]
    ev += [{"kind": "step", "t0": float(s), "t1": s + 0.9, "step": s} for s in range(3)]
    ev += [{"kind": "step", "t0": 3.5 + s - 3, "t1": 4.4 + s - 3, "step": s} for s in range(3, 9)]
    ev += [{"kind": "chaos", "t0": 2.05, "t1": 2.05, "fault": "disk_full@step=2,for=5"},
           {"kind": "chaos", "t0": 3.0, "t1": 3.0, "fault": "kill@step=3,rank=1"},
           {"kind": "fault", "t0": 3.0, "t1": 3.2, "cause": "process_crash"},
           {"kind": "fault", "t0": 5.0, "t1": 5.4, "cause": "checkpoint_write_failed"}]  # fmt: skip
    disk, kill = injected_faults(ev, "disk_full@step=2,for=5;kill@step=3,rank=1", tmp_path)
    assert disk["kind"] == "disk_full" and disk["detected"]
    assert disk["detected_as"] == "checkpoint_write_failed"
    assert disk["detect_s"] == pytest.approx(5.4 - 2.05)
    assert disk["to_productive_s"] == pytest.approx(6.4 - 5.4)  # the step begun at 5.5
    assert disk["steps_lost"] == 0
    assert kill["detected_as"] == "process_crash"  # not the later checkpoint failure
    # Never written to while full: not detected (nothing noticed), nothing lost.
    quiet = [e for e in ev if "cause" not in e and "kill" not in e.get("fault", "")]
    [quiet] = injected_faults(quiet, "disk_full@step=2,for=5", tmp_path)
    assert not quiet["detected"] and quiet["steps_lost"] == 0


def test_drill_rows_say_whether_detection_came_within_the_learned_limit(tmp_path):
    """The supervisor writes the limit each fault was judged by (limit_s) into its timeline
    fault event; the drill compares the detection latency with it (one poll's slack)."""
    ev = [{"kind": "job", "t0": 0.0, "t1": 30.0}]
    ev += [{"kind": "step", "t0": float(s), "t1": s + 0.9, "step": s} for s in range(20)]
    ev += [{"kind": "chaos", "t0": 2.0, "t1": 2.0, "fault": "stop@step=2,rank=1"},
           {"kind": "fault", "t0": 2.1, "t1": 5.3, "cause": "hang", "limit_s": 3.0},
           {"kind": "chaos", "t0": 9.0, "t1": 9.0, "fault": "stop@step=9,rank=1"},
           {"kind": "fault", "t0": 9.1, "t1": 19.0, "cause": "hang", "limit_s": 3.0},
           {"kind": "chaos", "t0": 21.0, "t1": 21.0, "fault": "kill@step=21,rank=1"},
           {"kind": "fault", "t0": 21.0, "t1": 21.2, "cause": "process_crash"}]  # fmt: skip
    sched = "stop@step=2,rank=1;stop@step=9,rank=1;kill@step=21,rank=1"
    fast, slow, old = injected_faults(ev, sched, tmp_path)
    assert (fast["limit_s"], fast["within_limit"]) == (3.0, True)  # 3.3 s: the limit + a poll
    assert (slow["limit_s"], slow["within_limit"]) == (3.0, False)  # 10 s: a fixed time-out
    assert (old["limit_s"], old["within_limit"]) == (None, None)  # a timeline from before


@needs_tmpfs
def test_a_fault_the_ledger_cannot_record_on_a_full_disk_does_not_end_the_job(tmp_path, capsys):
    """The fault ledger on a disk that fills up: recording a fault raised "fault ledger ... is
    unusable (database or disk is full): if it is an old ledger, move it aside", which ended
    the job and hid the fault it was recording. Now the ledger names the full disk, and the
    supervisor says the fault was not recorded and goes on (restart decided as usual)."""
    from wanka.config import JobConfig
    from wanka.resilience.supervisor import Outcome, Supervisor

    with small_filesystem(tmp_path / "disk", 1) as disk:
        cfg = JobConfig()
        cfg.run.dir = str(tmp_path / "run")
        cfg.resilience.snapshot_dir = str(tmp_path / "shm")
        cfg.resilience.ledger = str(disk / "faults.sqlite")
        sup = Supervisor(cfg, ["train"], 2, None)
        with open(disk / "filler", "wb") as f:  # the rest of the disk
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        out = Outcome("process_crash", rank=1, max_step=3, detail="exit code 1 " + "x" * 200_000)
        assert sup._record_fault(out, 1) is False
        sup._record_fault(out, 1)  # said once
    err = capsys.readouterr().err
    assert err.count("not recorded: fault ledger") == 1, err
    assert "its disk is full" in err and "free space there" in err and "old ledger" not in err, err
