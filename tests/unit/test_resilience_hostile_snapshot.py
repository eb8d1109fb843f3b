"""Hostile schedules against the in-memory snapshots: a rank one snapshot ahead of its peers when
a fault struck (its peer died late in a step) must not overwrite the snapshot the job resumed
from with its first save after the restore; a second fault in that step would otherwise find no
step every rank holds and the job would fall back to disk (or step 0)."""

import threading

import torch

from wanka.resilience import snapshot as snap
from wanka.resilience.snapshot import SnapshotStore


def _store(tmp_path) -> SnapshotStore:
    # rank 0 of 2 on one node (no replica): the peer's inventory is faked at the gather
    return SnapshotStore(tmp_path / "shm", "job", "n0", 0, 2, 2, replica=False, signature="s",
                         overlap=True)  # fmt: skip


def _steps(store: SnapshotStore) -> list[int]:
    return [s for s, _ in snap._committed(store.dir, "s")]


def test_first_save_after_a_restore_keeps_the_restored_snapshot(tmp_path, monkeypatch):
    # Attempt 1: rank 0 committed steps 4 and 5; its peer died before committing 5 (it has 3, 4).
    first = _store(tmp_path)
    for step in (3, 4, 5):
        first.save(step, {"w": torch.full((4,), float(step))})
    first.close()
    assert _steps(first) == [4, 5]

    def gather(out, mine):  # the peer holds steps 3 and 4 of its own
        out[0], out[1] = mine, {"rank": 1, "sig": "s", "have": {1: [3, 4]}}

    monkeypatch.setattr(snap.dist, "all_gather_object", gather)
    store = _store(tmp_path)  # attempt 2
    step, state = store.restore()
    assert step == 4 and torch.equal(state["w"], torch.full((4,), 4.0))
    # The first save after the restore (step 5 again): while it copies, and after it commits,
    # the restored step 4 must still be there (before the fix it was the slot overwritten).
    release = threading.Event()
    real = torch._foreach_copy_

    def held_copy(dst, src):
        release.wait(10)
        real(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", held_copy)
    store.save(5, {"w": torch.full((4,), 5.0)})
    assert 4 in _steps(store), "the snapshot of the step resumed from was overwritten"
    again = [None, None]
    mine = {"rank": 0, "sig": "s", "have": {}}
    for owner, s in store._copies_here():
        mine["have"].setdefault(owner, []).append(s)
    gather(again, mine)  # a second fault now: a step every rank holds still exists
    common = set(again[0]["have"].get(0, [])) & set(again[1]["have"][1])
    assert common == {4}
    release.set()
    store.settle()
    assert _steps(store) == [4, 5]
    store.close(discard=True)
