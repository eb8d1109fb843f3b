"""Going back: checkpoint.load of an older checkpoint moves the newer ones aside (kept), so
restarts and pruning follow the run from there; a copied run directory gets a job id (and so
in-memory snapshots) of its own; folder names that are not a checkpoint's are not taken for
one (all found by an attacker: a restart resumed the abandoned history, keep=1 deleted each
checkpoint the rollback wrote, a copy restored the original's live snapshots)."""

import shutil

import torch

from wanka.train.checkpoint import (
    Checkpointer,
    complete_checkpoints,
    supersede,
    verify,
    write_manifest,
)


def _ckpt(root, step: int, name: str | None = None):
    d = root / (name or f"step-{step:08d}")
    d.mkdir(parents=True)
    (d / "shard.bin").write_bytes(bytes([step]) * 8)
    write_manifest(d, step)
    return d


def test_going_back_moves_the_newer_checkpoints_aside_and_keeps_them(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (4, 8, 12):
        _ckpt(root, s)
    aside = supersede(root, root / "step-00000004")
    assert aside is not None and aside.parent == root and aside.name.startswith("superseded-")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000008", "step-00000012"]
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000004"]
    assert supersede(root, root / "step-00000004") is None  # nothing newer: nothing moved


def test_starting_from_another_runs_checkpoint_sets_all_of_this_runs_aside(tmp_path):
    root, other = tmp_path / "run" / "checkpoints", tmp_path / "other" / "checkpoints"
    _ckpt(root, 2)
    _ckpt(root, 20)
    aside = supersede(root, _ckpt(other, 8))
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000002", "step-00000020"]
    assert complete_checkpoints(root) == []


def test_pruning_after_going_back_keeps_what_the_run_wrote(tmp_path):
    root = tmp_path / "checkpoints"
    model = torch.nn.Linear(4, 4)
    ck = Checkpointer(root, model, torch.optim.SGD(model.parameters(), lr=0.1), keep=1,
                      async_save=False, is_main=True)  # fmt: skip
    for s in (4, 8, 12):  # an earlier run's (keep = 3)
        _ckpt(root, s)
    supersede(root, root / "step-00000004")
    ck.save(6, {})  # the run from step 4 on, keep = 1
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000006"]  # 4 pruned
    assert len(list(root.glob("superseded-*/step-*"))) == 2


def test_names_that_are_not_a_checkpoints_are_not_taken_for_one(tmp_path):
    root = tmp_path / "checkpoints"
    good = _ckpt(root, 12)
    shutil.copytree(good, root / "step-00000012.bak")  # a user's copy
    copy = shutil.copytree(_ckpt(root, 8), root / "step-00000099")  # step 8 under 99's name
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000008", "step-00000012",
                                                             "step-00000099"]  # fmt: skip
    assert verify(good) is None
    assert "manifest is of step 8" in verify(copy)
    (root / "step-00000030").write_text("a file")  # not a folder: not a checkpoint
    assert "step-00000030" not in [p.name for p in complete_checkpoints(root)]


def test_a_copied_run_directory_gets_its_own_job_id(tmp_path):
    from wanka.resilience.supervisor import job_id

    run = tmp_path / "run"
    run.mkdir()
    first = job_id(run)
    assert job_id(run) == first
    moved = tmp_path / "moved"
    run.rename(moved)  # a move keeps the folder (and so the snapshots)
    assert job_id(moved) == first
    copy = shutil.copytree(moved, tmp_path / "copy")
    assert (copy / "resilience" / "job_id").read_text().strip() == first  # copied along
    assert job_id(copy) != first and job_id(copy) == job_id(copy)
    assert job_id(moved) == first


def test_forget_uncommits_every_snapshot_a_rank_holds(tmp_path):
    from wanka.resilience.snapshot import SnapshotStore

    store = SnapshotStore(tmp_path, "job", "n0", 0, 1, 1, replica=False, signature="sig")
    store.save(3, {"model": {"w": torch.ones(4)}, "optim": {}, "extra": {}})
    store.wait()
    assert list(store.dir.glob("*.meta"))
    store.forget()
    assert not list(store.dir.glob("*.meta"))
    store.close(discard=True)


def test_a_snapshot_of_another_layout_is_noted_before_it_is_dropped(tmp_path):
    """A relaunch on another layout cannot restore the snapshot: the store says which step it
    drops (the resume warns), where it used to vanish silently (found by an attacker)."""
    from wanka.resilience.snapshot import SnapshotStore

    old = SnapshotStore(tmp_path, "job", "n0", 0, 1, 1, replica=False, signature="world2")
    old.save(3, {"model": {"w": torch.ones(4)}, "optim": {}, "extra": {}})
    old.wait()
    assert old.other_layout_step is None
    new = SnapshotStore(tmp_path, "job", "n0", 0, 1, 1, replica=False, signature="world1")
    assert new.other_layout_step == 3
    assert not list(new.dir.glob("*world2*"))  # dead weight in shared memory: gone
    new.close(discard=True)
