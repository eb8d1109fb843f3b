"""Context parallelism is exact: losses and every parameter's gradient under cp = 2, cp = 4 and
dp 2 x cp 2 equal one unsharded process on the same batch, for every layout and both phases."""

import pytest
import torch

from tests.distributed.cp_step import gather_group_ranks, run
from tests.distributed.helpers import losses, small_job, spawn, spawn_in_turn, train_job

LAYOUTS = ["contiguous", "head_tail", "dynamic"]
# Documents of very different lengths: short ones, some crossing row ends, one longer than a
# row (96 tokens), so every layout splits some documents and keeps others whole.
DOCS = [5, 30, 150, 12, 7, 61, 3, 40, 90, 18, 230, 9, 44]


def _check(res: dict, phases: list[str], layouts: list[str]) -> None:
    for phase in phases:
        ref = res[("reference", phase)]
        for layout in layouts:
            got = res[(layout, phase)]
            where = f"{layout}/{phase}"
            torch.testing.assert_close(got["sums"], ref["sums"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, w=where: f"{w} loss sums: {m}")  # fmt: skip
            assert got["grads"].keys() >= ref["grads"].keys(), where
            for name in got["grads"].keys() - ref["grads"].keys():  # no gradient = zero (FSDP)
                assert not got["grads"][name].any(), f"{where}: {name} should get no gradient"
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, w=where: f"{w} grad {n}: {m}")  # fmt: skip


CASES = [(2, 2, 1), (4, 4, 2), (4, 2, 2)]  # world, cp, ep


def _phases(world: int) -> list[str]:
    return ["sparse", "dense_warmup"] if world == 2 else ["sparse"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict:
    """Every spawned case of this file's exactness tests, in turn in one spawn per world size
    (2 and 4): DIR/NAME (rank 0's results, or NAME.RANK for the gather groups)."""
    out = tmp_path_factory.mktemp("cp_ranks")
    calls = {2: [], 4: []}
    for world, cp, ep in CASES:
        calls[world].append((run, str(out / f"cp{world}-{cp}-{ep}.pt"), cp, ep, LAYOUTS,
                             _phases(world), DOCS, 2 * (world // cp)))  # fmt: skip
    calls[2].append((run, str(out / "mla.pt"), 2, 1, LAYOUTS, ["sparse", "dense_warmup"], DOCS, 2,
                     {"attention": "mla"}))  # fmt: skip
    calls[4].append((run, str(out / "wide.pt"), 2, 1, ["dynamic_wide"], ["sparse"],
                     [96] + [2] * 150, 4))  # fmt: skip
    calls[4] += [(gather_group_ranks, str(out / f"g{cp}"), cp) for cp in (1, 2)]
    for world, cases in calls.items():
        spawn_in_turn(world, *cases)
    return out


@pytest.mark.parametrize("world,cp,ep", CASES)
def test_cp_matches_unsharded(ranks, world, cp, ep):
    phases = _phases(world)
    res = torch.load(ranks / f"cp{world}-{cp}-{ep}.pt", weights_only=False)
    _check(res, phases, LAYOUTS)
    for layout in LAYOUTS:  # every rank computed something
        assert all(n > 0 for n in res[(layout, phases[0])]["tokens"])


def test_cp_with_a_widened_gather_block_matches_unsharded(ranks):
    """dp 2 x cp 2 where the dynamic plan splits a document over all 4 ranks (span 4): one
    row is a single document that costs more than a CP group's share, the others hold short
    documents; the gather runs over both CP groups and the result is still the unsharded one."""
    res = torch.load(ranks / "wide.pt", weights_only=False)
    _check(res, ["sparse"], ["dynamic_wide"])
    assert res[("dynamic_wide", "sparse")]["spans"] == [4, 4]


@pytest.mark.parametrize("cp", [1, 2])
def test_gather_groups_are_aligned_blocks_of_whole_cp_groups(ranks, cp):
    got = [eval((ranks / f"g{cp}.{r}").read_text()) for r in range(4)]
    if cp == 1:  # no context parallelism: no gather groups at all
        assert got == [[]] * 4
        return
    for r in range(4):
        assert got[r] == [(2, [r // 2 * 2, r // 2 * 2 + 1]), (4, [0, 1, 2, 3])]


@pytest.fixture(scope="module")
def one_rank(dataset, tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the single-process job (4 steps, micro-batch 2) that both whole-job
    tests below compare with: the same job for both, so it runs once."""
    run_dir = tmp_path_factory.mktemp("cp_one_rank") / "one"
    spawn(1, train_job, small_job(dataset, run_dir, "train.micro_batch_size=2",
                                  "checkpoint.enable=false"))  # fmt: skip
    return losses(run_dir)


def test_cp_training_job_matches_single_process(job_args, tmp_path, one_rank):
    """The whole trainer: per-step losses with cp = 2 (dynamic) equal one process."""
    spawn(2, train_job, job_args("cp", "train.micro_batch_size=2", "parallel.cp=2",
                                 "checkpoint.enable=false"))  # fmt: skip
    one, cp = one_rank, losses(tmp_path / "cp")
    assert one.keys() == cp.keys() and len(one) == 4
    for k in one:
        assert cp[k] == pytest.approx(one[k], rel=2e-5), f"step {k}: {cp[k]} vs {one[k]}"


def test_resume_across_a_change_of_cp(job_args, tmp_path, one_rank):
    """Checkpoint at step 2 with cp = 2 (2 ranks), resume with cp = 1 (1 rank): DCP reshards,
    the loader state is cp-free, and steps 3-4 equal an uninterrupted cp = 1 run."""
    common = ("train.micro_batch_size=2", "checkpoint.every=2", "train.lr_horizon=4")
    spawn(2, train_job, job_args("moved", *common, "parallel.cp=2", "train.steps=2"))
    spawn(1, train_job, job_args("moved", *common))
    ref, moved = one_rank, losses(tmp_path / "moved")
    for k in (3, 4):
        assert moved[k] == pytest.approx(ref[k], rel=2e-5), f"step {k}: {moved[k]} vs {ref[k]}"


def test_cp_with_mla_matches_unsharded(ranks):
    """MLA's one key = value latent (gathered once, not as K and V) under cp = 2."""
    _check(torch.load(ranks / "mla.pt", weights_only=False), ["sparse", "dense_warmup"], LAYOUTS)
