"""In-memory snapshots on 2 gloo ranks, each its own "node": replicas, node loss, exact restore."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.helpers import spawn_in_turn


def _snapshot_ranks(root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wanka.resilience.snapshot import SnapshotStore, apply, capture, layout_signature

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(5, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    def local_state() -> list[torch.Tensor]:
        sd = capture(model, opt, {})
        return [t.clone() for t in sd["model"].values()] + [
            v.clone() for s in sd["optim"]["state"].values() for v in s.values()
        ]

    # local_world_size=1: each rank is a node of its own, so each snapshot gets a replica.
    store = SnapshotStore(root, "job", f"n{rank}", rank, 2, 1, replica=True,
                          signature=layout_signature(model, 2))  # fmt: skip
    step()
    store.save(1, capture(model, opt, {"at": 1}))
    step()
    store.save(2, capture(model, opt, {"at": 2}))
    store.wait()
    expected = local_state()
    step()  # move on, so a restore has something to undo
    dist.barrier()
    if rank == 1:
        shutil.rmtree(f"{root}/job/n1/rank1")  # node n1 lost its memory; n0 holds its replica
    dist.barrier()
    found = store.restore()
    assert found is not None and found[0] == 2, found and found[0]
    extra = apply(found[1], model, opt)
    assert extra == {"at": 2}
    got = local_state()
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    step()  # the restored optimizer state (DTensors again) still steps
    # A layout mismatch (another world size) is refused, so DCP is used instead.
    store.signature = "w4-000000000000"
    assert store.restore() is None
    store.close()
    dist.barrier()
    if rank == 0:
        open(out, "w").write("ok")
    dist.destroy_process_group()


def _torn_slot_ranks(root: str, out: str) -> None:
    import torch.distributed as dist

    from wanka.resilience.snapshot import SnapshotStore

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    store = SnapshotStore(root, "job", "n0", rank, 2, 2, replica=True, signature="w2-x")
    assert store.send_to is None  # one node: nothing to replicate to
    w = torch.arange(10, dtype=torch.float32) + rank
    for step in (1, 2):
        store.save(step, {"w": w * step, "extra": {"step": step}})
    slots = sorted(p.name for p in store.dir.glob("*.meta"))
    assert [n[:13] for n in slots] == ["step-00000001", "step-00000002"], slots
    # A third save overwrites the slot of step 1, never step 2's. Simulate a kill in the
    # middle of that copy: step 1's meta is gone before the slot changes, step 2 is intact.
    slot_of_1 = next(store.dir.glob("step-00000001.*")).name.split(".")[1]
    (store.dir / f"step-00000001.{slot_of_1}.w2-x.meta").unlink()
    store._map(store.dir / f"slot{slot_of_1[1]}.w2-x.bin", 64).fill_(255)  # garbage, uncommitted
    fresh = SnapshotStore(root, "job", "n0", rank, 2, 2, replica=True, signature="w2-x")
    step, state = fresh.restore()
    assert step == 2 and torch.equal(state["w"], w * 2) and state["extra"] == {"step": 2}
    state["w"].add_(1)  # the restored tensors are the caller's, not views of shared memory
    assert torch.equal(fresh.restore()[1]["w"], w * 2)
    # The next save goes to the slot that does not hold step 2.
    fresh.save(3, {"w": w * 3, "extra": {"step": 3}})
    assert fresh.restore()[0] == 3
    assert sorted(p.name[:13] for p in fresh.dir.glob("*.meta")) == ["step-00000002",
                                                                     "step-00000003"]  # fmt: skip
    fresh.close(discard=True)
    assert not fresh.dir.exists()
    dist.barrier()
    if rank == 0:
        open(out, "w").write("ok")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """The three 2-rank cases of this file in turn, in one spawn (the checks inside the ranks
    fail that spawn), each with its own folder: DIR/CASE/shm and DIR/CASE/ok."""
    out = tmp_path_factory.mktemp("snapshot_ranks")
    cases = {"torn": _torn_slot_ranks, "replica": _snapshot_ranks, "moved": _moved_ranks}
    for case in cases:
        (out / case).mkdir()
    spawn_in_turn(2, *((fn, str(out / case / "shm"), str(out / case / "ok"))
                       for case, fn in cases.items()))  # fmt: skip
    return out


def test_snapshot_slots_survive_a_torn_copy(two_ranks):
    assert (two_ranks / "torn" / "ok").read_text() == "ok"


def test_snapshot_replica_restores_a_lost_node(two_ranks):
    assert (two_ranks / "replica" / "ok").read_text() == "ok"
    # Rank 1's own copy was re-created from the replica, for the next fault.
    rank1 = two_ranks / "replica" / "shm" / "job" / "n1" / "rank1"
    assert len(list(rank1.glob("step-00000002.s?.w2-*.meta"))) == 1


def _moved_ranks(root: str, out: str) -> None:
    import torch.distributed as dist

    from wanka.resilience.snapshot import SnapshotStore

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = torch.arange(6, dtype=torch.float32) + 10 * rank
    store = SnapshotStore(root, "job", f"n{rank}", rank, 2, 1, replica=True, signature="w2-x")
    for step in (1, 2):
        store.save(step, {"w": w * step})
    store.wait()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/job/n0")  # n0 lost; n1 holds rank 1's copy and rank 0's replica
    dist.barrier()
    # A hot spare n2 took n0's place and ranks changed nodes (a c10d rendezvous, as under Slurm,
    # numbers nodes by address): rank 0 now runs on n1, rank 1 on n2 (empty). Rank 0 finds its own state in n1's replica folder,
    # rank 1 gets its copy from n1 (from rank 0) over the network.
    moved = SnapshotStore(root, "job", ["n1", "n2"][rank], rank, 2, 1, replica=True,
                          signature="w2-x")  # fmt: skip
    step, state = moved.restore()
    assert step == 2 and torch.equal(state["w"], w * 2), (rank, step, state)
    moved.save(3, {"w": w * 3})  # and it goes on saving, with its replica
    moved.wait()
    assert moved.restore()[0] == 3
    moved.close()
    store.close()
    dist.barrier()
    if rank == 0:
        open(out, "w").write("ok")
    dist.destroy_process_group()


def test_ranks_that_moved_to_other_nodes_restore_from_any_copy_there(two_ranks):
    assert (two_ranks / "moved" / "ok").read_text() == "ok"
