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
    w.add_(100)  # the state changes only after settle: the snapshot keeps step 1's values
    assert torch.equal(_saved(store, 1)["w"], torch.arange(6, dtype=torch.float32))
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

    monkeypatch.setattr(snap, "_atomic_write", full_disk)
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
