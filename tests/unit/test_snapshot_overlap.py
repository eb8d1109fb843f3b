"""Snapshots copied under the next step (resilience.snapshot_overlap): the copy runs on a copier
thread, commits only when whole, and settle() waits for it and surfaces its error."""

import pickle
import threading

import pytest
import torch

from wanka.resilience import snapshot as snap
from wanka.resilience.snapshot import SnapshotStore


def _store(tmp_path, overlap: bool = True) -> SnapshotStore:
    return SnapshotStore(tmp_path / "shm", "job", "n0", 0, 1, 1, replica=False, signature="s",
                         overlap=overlap)  # fmt: skip


def _saved(store: SnapshotStore, step: int) -> dict:
    meta, data = snap._read(store.dir, step, "s")
    table = pickle.loads(meta)["table"]
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return {"w": snap._views(buf, table)[0].clone()}


def test_save_returns_before_the_copy_and_settle_waits_for_its_commit(tmp_path, monkeypatch):
    store = _store(tmp_path)
    release, copying = threading.Event(), threading.Event()
    real = torch._foreach_copy_

    def slow_copy(dst, src):
        copying.set()
        release.wait(10)
        real(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", slow_copy)
    w = torch.arange(6, dtype=torch.float32)
    store.save(1, {"w": w})  # returns with the copy still held back
    assert copying.wait(10)
    assert snap._committed(store.dir, "s") == []  # not committed before it is whole
    release.set()
    store.settle()
    assert [s for s, _ in snap._committed(store.dir, "s")] == [1]
    assert torch.equal(_saved(store, 1)["w"], w)
    store.close(discard=True)


def test_consecutive_saves_alternate_slots_and_keep_the_last_two(tmp_path):
    store = _store(tmp_path)
    for step in (1, 2, 3):
        store.save(step, {"w": torch.full((4,), float(step))})
    store.settle()  # the next save settles the previous one itself; the last needs it
    assert [s for s, _ in snap._committed(store.dir, "s")] == [2, 3]
    assert torch.equal(_saved(store, 3)["w"], torch.full((4,), 3.0))
    assert store.settle() == 0.0  # nothing in flight any more
    store.close(discard=True)


def test_a_failed_copy_is_raised_at_settle_and_leaves_the_last_snapshot(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save(1, {"w": torch.ones(3)})
    store.settle()

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snap, "atomic_write", full_disk)
    store.save(2, {"w": torch.zeros(3)})
    with pytest.raises(OSError, match="No space"):
        store.settle()
    assert [s for s, _ in snap._committed(store.dir, "s")] == [1]
    assert torch.equal(_saved(store, 1)["w"], torch.ones(3))
    store.close()


def test_without_overlap_save_commits_before_returning(tmp_path):
    store = _store(tmp_path, overlap=False)
    store.save(1, {"w": torch.ones(2)})
    assert [s for s, _ in snap._committed(store.dir, "s")] == [1]
    assert store.settle() == 0.0
    store.close(discard=True)


def _runtime(tmp_path, monkeypatch):
    from wanka.config import JobConfig
    from wanka.resilience.worker import Runtime

    monkeypatch.setenv("WANKA_SUPERVISED", "1")
    monkeypatch.setenv("WANKA_JOB_ID", "job")
    cfg = JobConfig()
    cfg.run.dir = str(tmp_path / "run")
    cfg.resilience.snapshot_dir = str(tmp_path / "shm")
    cfg.resilience.last_gasp = False  # no signal handlers in the test process
    rt = Runtime(cfg, 0)
    phases = []
    rt.progress = type("P", (), {"enter": lambda self, ph, step=None: phases.append(ph)})()
    return rt, phases


def test_only_a_caller_that_settles_gets_overlapped_copies(tmp_path, monkeypatch):
    """Post-training's loop steps its optimizer without settle_snapshot: its store must copy
    inside save() whatever resilience.snapshot_overlap says; the trainer asks for overlap."""
    rt, _ = _runtime(tmp_path, monkeypatch)
    assert rt.cfg.resilience.snapshot_overlap  # the default
    assert rt.snapshot_store(1, 1, "s")._copier is None
    rt2, _ = _runtime(tmp_path / "b", monkeypatch)
    assert rt2.snapshot_store(1, 1, "s", overlap=True)._copier is not None
    rt2._snapshots.close(discard=True)


def test_a_wait_for_the_copy_is_the_snapshot_phase_and_a_stall(tmp_path, monkeypatch):
    rt, phases = _runtime(tmp_path, monkeypatch)
    store = rt.snapshot_store(1, 1, "s", overlap=True)
    events = []
    rt.event = lambda kind, t0, t1=None, **extra: events.append((kind, t1 - t0, extra))
    release = threading.Event()
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, s: (release.wait(10), real(d, s)))
    store.save(1, {"w": torch.ones(4)})
    threading.Timer(0.2, release.set).start()
    rt.settle_snapshot(0)
    assert phases == ["snapshot"]  # hang limits: the snapshot's phase, not the optimizer's
    assert len(events) == 1 and events[0][0] == "snapshot" and events[0][1] >= 0.1
    assert events[0][2] == {"step": 0, "waited": True}
    rt.settle_snapshot(1)  # nothing in flight: no phase, no stall
    assert phases == ["snapshot"] and len(events) == 1
    store.close(discard=True)
