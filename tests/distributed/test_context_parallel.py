"""Context parallelism is exact: losses and every parameter's gradient under cp = 2, cp = 4 and
dp 2 x cp 2 equal one unsharded process on the same batch, for every layout and both phases."""

import pytest
import torch

from tests.distributed.cp_step import gather_group_ranks, run
from tests.distributed.helpers import losses, spawn, train_job

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


@pytest.mark.parametrize("world,cp,ep", [(2, 2, 1), (4, 4, 2), (4, 2, 2)])
def test_cp_matches_unsharded(tmp_path, world, cp, ep):
    out = tmp_path / "res.pt"
    phases = ["sparse", "dense_warmup"] if world == 2 else ["sparse"]
    spawn(world, run, str(out), cp, ep, LAYOUTS, phases, DOCS, 2 * (world // cp))
    res = torch.load(out, weights_only=False)
    _check(res, phases, LAYOUTS)
    for layout in LAYOUTS:  # every rank computed something
        assert all(n > 0 for n in res[(layout, phases[0])]["tokens"])


def test_cp_with_a_widened_gather_block_matches_unsharded(tmp_path):
    """dp 2 x cp 2 where the dynamic plan splits a document over all 4 ranks (span 4): one
    row is a single document that costs more than a CP group's share, the others hold short
    documents; the gather runs over both CP groups and the result is still the unsharded one."""
    out = tmp_path / "res.pt"
    spawn(4, run, str(out), 2, 1, ["dynamic_wide"], ["sparse"], [96] + [2] * 150, 4)
    res = torch.load(out, weights_only=False)
    _check(res, ["sparse"], ["dynamic_wide"])
    assert res[("dynamic_wide", "sparse")]["spans"] == [4, 4]


@pytest.mark.parametrize("cp", [1, 2])
def test_gather_groups_are_aligned_blocks_of_whole_cp_groups(tmp_path, cp):
    spawn(4, gather_group_ranks, str(tmp_path / "g"), cp)
    got = [eval((tmp_path / f"g.{r}").read_text()) for r in range(4)]
    if cp == 1:  # no context parallelism: no gather groups at all
        assert got == [[]] * 4
        return
    for r in range(4):
        assert got[r] == [(2, [r // 2 * 2, r // 2 * 2 + 1]), (4, [0, 1, 2, 3])]


def test_cp_training_job_matches_single_process(job_args, tmp_path):
    """The whole trainer: per-step losses with cp = 2 (dynamic) equal one process."""
    spawn(1, train_job, job_args("one", "train.micro_batch_size=2", "checkpoint.enable=false"))
    spawn(2, train_job, job_args("cp", "train.micro_batch_size=2", "parallel.cp=2",
                                 "checkpoint.enable=false"))  # fmt: skip
    one, cp = losses(tmp_path / "one"), losses(tmp_path / "cp")
    assert one.keys() == cp.keys() and len(one) == 4
    for k in one:
        assert cp[k] == pytest.approx(one[k], rel=2e-5), f"step {k}: {cp[k]} vs {one[k]}"


def test_resume_across_a_change_of_cp(job_args, tmp_path):
    """Checkpoint at step 2 with cp = 2 (2 ranks), resume with cp = 1 (1 rank): DCP reshards,
    the loader state is cp-free, and steps 3-4 equal an uninterrupted cp = 1 run."""
    spawn(1, train_job, job_args("ref", "train.micro_batch_size=2", "checkpoint.enable=false"))
    common = ("train.micro_batch_size=2", "checkpoint.every=2", "train.lr_horizon=4")
    spawn(2, train_job, job_args("moved", *common, "parallel.cp=2", "train.steps=2"))
    spawn(1, train_job, job_args("moved", *common))
    ref, moved = losses(tmp_path / "ref"), losses(tmp_path / "moved")
    for k in (3, 4):
        assert moved[k] == pytest.approx(ref[k], rel=2e-5), f"step {k}: {moved[k]} vs {ref[k]}"


def test_cp_with_mla_matches_unsharded(tmp_path):
    """MLA's one key = value latent (gathered once, not as K and V) under cp = 2."""
    out = tmp_path / "res.pt"
    spawn(2, run, str(out), 2, 1, LAYOUTS, ["sparse", "dense_warmup"], DOCS, 2,
          {"attention": "mla"})  # fmt: skip
    _check(torch.load(out, weights_only=False), ["sparse", "dense_warmup"], LAYOUTS)
