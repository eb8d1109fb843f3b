"""Edges of the resilience machinery found by an attacker: a full run-directory disk (learned
time-outs, the run lock, the pre-flight's room for checkpoints), a file in a checkpoint's way,
partial saves left by a killed attempt, chaos schedule typos, a second Ctrl-C, unreadable
checkpoints and an unwritable data.cache_dir. Each is one clear line, never a traceback."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from wanka.resilience.chaos import ChaosDriver, beyond_the_job, parse_schedule
from wanka.resilience.monitor import Timeouts
from wanka.train.checkpoint import (
    CORRUPT,
    PARTIAL,
    Checkpointer,
    CheckpointWriteError,
    complete_checkpoints,
    step_dir,
    write_manifest,
)
from wanka.train.run_lock import LOCK_NAME, RunLock, job_start

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# -- 4a: learned time-outs on a full disk -----------------------------------------------------
def test_timeouts_save_on_a_full_disk_says_one_line_and_leaves_no_temp_file(
    tmp_path, monkeypatch, capsys
):
    t = Timeouts(tmp_path / "timeouts.json", 3.0, 1.0, 60.0)
    t.learned = {"forward": 0.5}
    real_fdopen = os.fdopen

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, _text):
            raise OSError(ENOSPC.errno, ENOSPC.strerror)

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: FullFile(real_fdopen(fd, mode)))
    assert t.save() is False
    assert t.save() is False  # said once, not after every attempt
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "timeouts.json" in err[0]
    assert list(tmp_path.iterdir()) == []  # no .timeouts.json.*.tmp left behind
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert t.save() is True  # space again: saved
    assert Timeouts(tmp_path / "timeouts.json", 3.0, 1.0, 60.0).learned == {"forward": 0.5}


def test_unreadable_timeouts_file_costs_only_the_learned_values(tmp_path):
    (tmp_path / "timeouts.json").mkdir()  # read_text: IsADirectoryError
    assert Timeouts(tmp_path / "timeouts.json", 3.0, 1.0, 60.0).learned == {}


# -- 4b: the run lock on a full disk -------------------------------------------------------------
def test_full_disk_at_the_first_start_is_one_line_and_leaves_no_lock(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(ENOSPC.errno, ENOSPC.strerror)

    monkeypatch.setattr(os, "pwrite", full)
    run = tmp_path / "run"
    with pytest.raises(ValueError) as e:
        RunLock(run, "wanka train", shown="runs/x").acquire()
    msg = str(e.value)
    assert "\n" not in msg and "runs/x" in msg and "disk is full" in msg
    assert "free space there" in msg
    assert not (run / LOCK_NAME).exists() and not run.exists()  # made for the lock: gone too
    run.mkdir()
    with pytest.raises(ValueError, match="disk is full"):
        RunLock(run, "wanka train").acquire()
    assert list(run.iterdir()) == []  # an existing run dir stays, without an empty lock


def test_job_start_refuses_a_run_dir_on_a_full_disk(tmp_path, monkeypatch):
    from wanka.config import load_config
    from wanka.train import run_lock

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(run_lock.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 4096))
    cfg = load_config(None, [f'run.dir="{tmp_path / "run"}"',
                             f'resilience.snapshot_dir="{tmp_path / "shm"}"'])  # fmt: skip
    with pytest.raises(ValueError) as e:
        with job_start(cfg, {}, ["train"]):
            pass
    assert "\n" not in str(e.value) and "disk is full (4 KiB free)" in str(e.value)
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_stop_request_before_the_launch_ends_the_start_and_frees_the_lock(tmp_path):
    """SIGTERM in the seconds between the lock and the supervisor's own handlers (imports,
    pre-flight) killed `wanka train` silently (exit 143) and left its lock behind."""
    import signal

    from wanka.config import load_config
    from wanka.train.run_lock import StoppedBeforeStart

    cfg = load_config(None, [f'run.dir="{tmp_path / "run"}"',
                             f'resilience.snapshot_dir="{tmp_path / "shm"}"'])  # fmt: skip
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(StoppedBeforeStart, match=r"stopped on request \(SIGTERM\) before the job"):
        with job_start(cfg, {}, ["train"]):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert signal.getsignal(signal.SIGTERM) is before  # restored for whatever runs next


# -- 5: the pre-flight counts the checkpoints already on disk -----------------------------------
def _fake_checkpoint(root: Path, step: int, size: int) -> Path:
    d = step_dir(root, step)
    d.mkdir(parents=True)
    with open(d / "__0_0.distcp", "wb") as f:
        f.truncate(size)  # sparse: its size is what counts
    write_manifest(d, step)
    return d


def _checkpoint_check(tmp_path, monkeypatch, free: int, *extra: str):
    from wanka.config import load_config
    from wanka.resilience import preflight as pf

    cfg = load_config(None, [f'run.dir="{tmp_path / "run"}"', "checkpoint.keep=1",
                             f'resilience.snapshot_dir="{tmp_path / "shm"}"', *extra])  # fmt: skip
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda p: usage(1 << 40, 0, free))
    return pf._check_checkpoint(cfg), pf.checkpoint_bytes(cfg)


def test_preflight_counts_the_checkpoints_new_saves_replace(tmp_path, monkeypatch):
    _, size = _checkpoint_check(tmp_path, monkeypatch, 0)
    _fake_checkpoint(tmp_path / "run" / "checkpoints", 8, size)
    # keep=1 with one checkpoint there: the next save needs one more, not two.
    r, _ = _checkpoint_check(tmp_path, monkeypatch, int(1.5 * size))
    assert r.ok, r.message
    assert "MiB" in r.message and "GiB free" not in r.message
    assert "1 existing checkpoint(s)" in r.message
    r, _ = _checkpoint_check(tmp_path, monkeypatch, size // 2)
    assert not r.ok and "free disk space" in r.message
    assert f"{size / 2**20 / 2:.1f} MiB free" in r.message  # never "0.0 GiB free"
    # checkpoint.load='none' would keep nothing of it: no such credit (it is refused anyway).


def test_the_checkpoint_estimate_covers_a_real_checkpoint(tmp_path):
    """The bare 12 bytes per parameter missed DCP's records, metadata and the train state: a
    job passed the pre-flight and then failed its saves on a disk that fit the estimate."""
    from wanka.config import load_config
    from wanka.models.transformer import Transformer
    from wanka.resilience import preflight as pf

    cfg = load_config(None, ["model.flavor=tiny", "model.n_layers=2"])
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # the moments and step counters exist, as in any checkpoint past step 0
    ck = Checkpointer(tmp_path, model, opt, keep=1, async_save=False, is_main=True)
    state = {"rng": torch.get_rng_state(), "loader": {"epoch": 0, "index": 12}}
    saved = ck.save(1, state)
    on_disk = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    assert pf.param_counts(cfg).total * 12 < on_disk <= pf.checkpoint_bytes(cfg)


def test_preflight_without_checkpoints_asks_for_keep_plus_one(tmp_path, monkeypatch):
    r, size = _checkpoint_check(tmp_path, monkeypatch, int(1.5 * (1 << 20)))
    assert not r.ok and "2 x " in r.message and "1.5 MiB free" in r.message
    r, _ = _checkpoint_check(tmp_path, monkeypatch, 2 * size + 1)
    assert r.ok and "beyond" not in r.message


# -- 7: a file where a checkpoint must go ---------------------------------------------------------
def _checkpointer(root, keep=2):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Checkpointer(root, model, opt, keep=keep, async_save=False, is_main=True)


def test_a_file_in_a_checkpoints_way_is_named_and_kept(tmp_path, caplog):
    ck = _checkpointer(tmp_path)
    blocker = step_dir(tmp_path, 2)
    blocker.write_text("mine")
    with caplog.at_level(logging.ERROR, logger="wanka.checkpoint"):
        assert ck.save(2, {}, must_succeed=False) is None
    [msg] = [r.getMessage() for r in caplog.records if "NOT written" in r.getMessage()]
    assert f"{blocker} is a file" in msg and "in the way" in msg and "Move or delete it" in msg
    assert "Free space" not in msg and "Not a directory" not in msg
    assert blocker.read_text() == "mine"  # never deleted
    assert not list(tmp_path.glob(PARTIAL + "*"))
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(2, {})
    assert "move or delete it" in str(e.value) and "free space" not in str(e.value)
    assert ck.save(3, {}) is not None  # other steps save as before


def test_a_checkpoint_changed_between_its_check_and_its_load_is_named_so(tmp_path):
    """'latest' checked step 2, then one of its files went before the load: the error told a
    user already on 'latest' to pick an earlier one or use 'latest'."""
    ck = _checkpointer(tmp_path)
    ck.save(1, {})
    ck.save(2, {})
    found = ck.latest_valid()
    assert found == step_dir(tmp_path, 2)
    next(found.glob("*.distcp")).unlink()
    with pytest.raises(ValueError) as e:
        ck.load(found, {})
    msg = str(e.value)
    assert "is missing: it changed after it was checked" in msg and "run the same command" in msg
    assert "'latest'" not in msg
    assert ck.latest_valid() == step_dir(tmp_path, 1)  # the next start takes the sound one


def test_a_checkpoint_that_lost_its_manifest_is_said_when_skipped(tmp_path, caplog):
    ck = _checkpointer(tmp_path)
    ck.save(1, {})
    ck.save(2, {})
    (step_dir(tmp_path, 2) / "COMPLETE").unlink()
    with caplog.at_level(logging.ERROR, logger="wanka.checkpoint"):
        assert ck.latest_valid() == step_dir(tmp_path, 1)
    [msg] = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert msg.startswith("skipping checkpoint step-00000002: it has no COMPLETE manifest")
    assert step_dir(tmp_path, 2).is_dir()  # kept


def test_a_file_named_like_a_partial_save_is_replaced(tmp_path):
    ck = _checkpointer(tmp_path)
    (tmp_path / f"{PARTIAL}step-00000002").write_text("stale")
    assert ck.save(2, {}) == step_dir(tmp_path, 2)


# -- 8: partials of a killed attempt go when the supervisor relaunches ------------------------
def test_a_relaunched_attempt_removes_partial_saves(tmp_path, monkeypatch, caplog):
    ck = _checkpointer(tmp_path)
    ck.save(1, {})
    partial = tmp_path / f"{PARTIAL}step-00000002"
    (partial / "x").mkdir(parents=True)
    monkeypatch.delenv("WANKA_SUPERVISED", raising=False)
    assert ck.latest_valid() == step_dir(tmp_path, 1)
    assert partial.exists()  # not supervised (e.g. a look from outside): never touched
    monkeypatch.setenv("WANKA_SUPERVISED", "1")
    monkeypatch.setenv("WANKA_ATTEMPT", "1")
    ck.latest_valid()
    assert partial.exists()  # the first attempt: job start removed them, under the lock
    monkeypatch.setenv("WANKA_ATTEMPT", "2")
    with caplog.at_level(logging.WARNING, logger="wanka.checkpoint"):
        assert ck.latest_valid() == step_dir(tmp_path, 1)
    assert not partial.exists()
    assert any("never finished" in r.getMessage() for r in caplog.records)


# -- 9: chaos schedule typos ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            "kill@step=3,rnak=1",
            r"unknown parameter 'rnak' \(kill takes step=N, t=SECONDS, rank=R\)",
        ),
        ("stop@step=3,rank=1,for=2", "unknown parameter 'for'"),
        ("kill@t=-5", "t must be >= 0"),
        ("kill@step=3,rank=1,rank=0", "rank= given twice"),
        ("kill@step=3.5", "step must be a whole number"),
        ("slow@step=2,ms=-5", "ms must be > 0"),
        ("fail_start@node=1,times=0", "times must be > 0"),
        ("nan@t=5", "unknown parameter 't'"),
        ("kill@step=3,t=inf", "finite number"),
        ("sigterm@step=3,rank=1", "unknown parameter 'rank'"),
        ("kill@step=3,rank=1.5", "rank must be a whole number"),
        ("kill@step", "must be key=number"),
    ],
)
def test_chaos_schedule_typos_are_refused_in_one_line(text, why):
    with pytest.raises(ValueError, match=why) as e:
        parse_schedule(text)
    assert "\n" not in str(e.value) and text in str(e.value)


def test_valid_schedules_still_parse():
    fs = parse_schedule("kill@step=3,rank=1;stop@t=2.5;fail_start@node=1,times=2;"
                        "slow@step=4,rank=1,ms=50,steps=2;link_cut@t=5,node=1,for=2.5;"
                        "disk_full@step=2,for=1.5,keep_mb=2")  # fmt: skip
    assert [f.kind for f in fs] == ["kill", "stop", "fail_start", "slow", "link_cut", "disk_full"]
    assert fs[0].rank == 1 and fs[1].rank == 0 and fs[2].params == {"node": 1, "times": 2}
    for f in fs:
        assert parse_schedule(f.spec())[0].spec() == f.spec()  # what the ranks are sent


def test_a_fault_beyond_the_job_is_said(tmp_path, capsys):
    faults = parse_schedule("kill@step=99;kill@step=12,rank=1;stop@t=5")

    class Timeline:
        def event(self, *a, **k):
            pass

    ChaosDriver(faults, tmp_path / "run", "job", str(tmp_path / "shm"), Timeline(), steps=12)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["wanka train: chaos fault 'kill@step=99,rank=0' never fires: step 99 is "
                   "beyond train.steps=12; give a step of 1..12"]  # fmt: skip
    assert beyond_the_job(faults, 99) == []


# -- 10a: a second stop signal after the agent's -------------------------------------------------
def test_the_agents_leftover_signal_handlers_are_replaced():
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    from wanka.resilience.supervisor import Supervisor

    sigs = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in sigs}
    got = []
    fake = types.SimpleNamespace(_on_stop_request=lambda signum, frame: got.append(signum))
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        Supervisor._catch_stop_requests(fake)  # before any attempt: Ctrl-C stays Python's
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
        for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):  # what an attempt leaves
            signal.signal(s, _terminate_process_handler)
        Supervisor._catch_stop_requests(fake)
        for s in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            os.kill(os.getpid(), s)  # torch's handler would raise SignalException here
        assert sorted(got) == sorted([signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
    finally:
        for s, h in before.items():
            signal.signal(s, h)


# -- 10b: an unreadable checkpoint ----------------------------------------------------------------
def test_an_unreadable_checkpoint_is_skipped_in_one_line(tmp_path, monkeypatch, caplog):
    ck = _checkpointer(tmp_path)
    ck.save(1, {})
    ck.save(2, {})
    locked = step_dir(tmp_path, 2)
    real_stat, real_listdir = os.stat, os.listdir

    def stat(p, *a, **k):  # what a mode-000 folder does to a user other than root
        if Path(p).parent == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
        return real_stat(p, *a, **k)

    def listdir(p="."):
        if Path(p) == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(p))
        return real_listdir(p)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "listdir", listdir)
    with caplog.at_level(logging.ERROR, logger="wanka.checkpoint"):
        assert ck.latest_valid() == step_dir(tmp_path, 1)  # the previous one
    said = [r.getMessage() for r in caplog.records if r.name == "wanka.checkpoint"]
    assert said == ["skipping checkpoint step-00000002: cannot be read (Permission denied); "
                    "fix its permissions to use it"]  # fmt: skip
    assert complete_checkpoints(tmp_path) == [step_dir(tmp_path, 1)]  # never pruned either
    monkeypatch.setattr(os, "stat", real_stat)
    assert not (locked / CORRUPT).exists()  # not damaged: never flagged
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(ValueError, match="cannot be read .Permission denied.: fix its perm"):
        ck.load(locked, {})


def test_a_checkpoint_that_cannot_be_flagged_is_still_skipped(tmp_path, monkeypatch, caplog):
    from wanka.resilience.chaos import damage_latest_checkpoint

    ck = _checkpointer(tmp_path)
    ck.save(1, {})
    ck.save(2, {})
    damage_latest_checkpoint(tmp_path, "truncate_ckpt")
    real_write = Path.write_text

    def read_only(self, *a, **k):
        if self.name == CORRUPT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_write(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", read_only)
    with caplog.at_level(logging.ERROR, logger="wanka.checkpoint"):
        assert ck.latest_valid() == step_dir(tmp_path, 1)
    assert any("could not be flagged corrupt (Read-only file system)" in r.getMessage()
               for r in caplog.records)  # fmt: skip


NOBODY = shutil.which("setpriv") is not None and os.geteuid() == 0


@pytest.mark.skipif(not NOBODY and os.geteuid() == 0, reason="needs setpriv to drop root")
def test_a_mode_000_checkpoint_as_a_user(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="wanka-perm-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "checkpoints"
        for step in (4, 8):
            _fake_checkpoint(root, step, 4096)
        for p in (root, *root.iterdir()):
            p.chmod(0o755)
            for f in p.iterdir() if p != root else ():
                f.chmod(0o644)
        step_dir(root, 8).chmod(0)
        code = ("import sys; from pathlib import Path; "
                "from wanka.train.checkpoint import complete_checkpoints, unreadable_checkpoints; "
                f"r = Path({str(root)!r}); print([p.name for p in complete_checkpoints(r)]); "
                "print([(p.name, w) for p, w in unreadable_checkpoints(r)])")  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
        cmd = [sys.executable, "-c", code]
        if os.geteuid() == 0:
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                             cwd="/tmp", check=False)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["['step-00000004']",
                                           "[('step-00000008', 'Permission denied')]"]  # fmt: skip
    finally:
        step_dir(base / "checkpoints", 8).chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


# -- 10c: an unwritable data.cache_dir -------------------------------------------------------------
def test_an_unwritable_cache_dir_is_one_line_naming_data_cache_dir(tmp_path, monkeypatch):
    from wanka.data import prepare

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x"))

    monkeypatch.setattr(prepare, "prepare_documents", denied)
    with pytest.raises(ValueError) as e:
        prepare.ensure_builtin_dataset(tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and f"data.cache_dir='{tmp_path / 'cache'}'" in msg
    assert "Permission denied" in msg and "point data.cache_dir at a writable directory" in msg
