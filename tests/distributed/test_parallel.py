"""2-rank gloo runs compared with a single-process run on the same global batch."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed.helpers import losses, small_job, spawn, spawn_jobs, train_job


def _close(a: dict, b: dict, rtol=2e-4):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=rtol), f"step {k}: {a[k]} vs {b[k]}"


NO_CKPT = "checkpoint.enable=false"
MLA = 'model.attention="mla"'
# The independent jobs that this file's comparisons read (name: overrides), by world size: run
# once, in one spawn per world size, each in its own run dir. "one" is the single-process
# reference (global batch 4 in one micro-batch, 4 steps) of the dp, ep and accumulation tests.
JOBS = {
    1: {"one": ["train.micro_batch_size=4", NO_CKPT],
        "acc": ["train.micro_batch_size=2", "train.grad_accum=2", NO_CKPT],
        "one3": ["train.micro_batch_size=4", "train.steps=3", NO_CKPT],
        "mla1": ["train.micro_batch_size=4", MLA, NO_CKPT]},
    2: {"two": ["train.micro_batch_size=2", NO_CKPT],
        "ep": ["train.micro_batch_size=2", "parallel.ep=2", NO_CKPT],
        "mla2": ["train.micro_batch_size=2", "parallel.ep=2", MLA, NO_CKPT]},
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    for world, jobs in JOBS.items():
        spawn_jobs(world, *(small_job(dataset, out / name, *extra) for name, extra in jobs.items()))
    return out


def test_fsdp_data_parallel_matches_single_process(runs):
    one, two = losses(runs / "one"), losses(runs / "two")
    assert len(one) == 4
    _close(one, two)
    assert one[4] < one[1], "loss should fall"


def test_expert_parallel_matches_non_parallel(runs):
    _close(losses(runs / "one"), losses(runs / "ep"))


def test_grad_accumulation_matches_bigger_batch(runs):
    _close(losses(runs / "one"), losses(runs / "acc"))


def test_save_on_two_ranks_load_on_one(job_args, tmp_path):
    """A checkpoint written by 2 ranks (dp x ep) resumes on 1 rank and continues identically."""
    spawn(
        2,
        train_job,
        job_args("two", "train.micro_batch_size=2", "parallel.ep=2", "checkpoint.every=2"),
    )
    ck = tmp_path / "two" / "checkpoints" / "step-00000002"
    assert (ck / "COMPLETE").is_file()
    spawn(1, train_job, job_args("one", "train.micro_batch_size=4", f'checkpoint.load="{ck}"'))
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(one) == [3, 4]
    _close({k: two[k] for k in (3, 4)}, one)


# The synchronous save on one rank is also what the integration and HSDP resume tests use:
# here in `make test-slow` only (CI time budget).
@pytest.mark.parametrize(
    "world, async_save", [pytest.param(1, False, marks=pytest.mark.slow), (2, True)]
)
def test_resume_is_exact(job_args, tmp_path, world, async_save):
    """Stop at step 2, resume: per-step losses equal an uninterrupted run, bitwise on CPU."""
    mb = f"train.micro_batch_size={4 // world}"
    ep = f"parallel.ep={world}"
    asy = f"checkpoint.async_save={str(async_save).lower()}"
    part = tmp_path / "part"
    args = job_args("part", mb, ep, asy, "checkpoint.every=2", "train.steps=5", "checkpoint.keep=5")
    spawn(world, train_job, args)
    full = losses(part)  # the uninterrupted run
    t_first = max(json.loads(x)["time"] for x in (part / "metrics.jsonl").read_text().splitlines())
    # Simulate a crash after step 2: only the step-2 checkpoint survives; rerun resumes from it.
    for d in (part / "checkpoints").glob("step-*"):
        if d.name != "step-00000002":
            shutil.rmtree(d)
    spawn(world, train_job, args)
    assert json.loads((part / "summary.json").read_text())["resumed_from_step"] == 2
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    redone = [r["step"] for r in rows if r.get("kind") == "train" and r["time"] > t_first]
    assert redone == [3, 4, 5]  # the rerun's own rows (the log is rewound to the resumed step)
    resumed = losses(part)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert full == resumed  # exact equality, not approx
    assert torch.tensor(list(full.values())).isfinite().all()


def test_four_ranks_dp4_ep2_matches_single_process(job_args, tmp_path, runs):
    """dp 4 x ep 2: experts split over ep and FSDP-sharded over dp_mod_ep = 2 (2-D sharding)."""
    spawn(4, train_job, job_args("four", "train.micro_batch_size=1", "train.steps=3", "parallel.ep=2",
                                 "checkpoint.enable=false"))  # fmt: skip
    _close(losses(runs / "one3"), losses(tmp_path / "four"))


def test_mla_under_fsdp_and_ep_matches_single_process(runs):
    one, two = losses(runs / "mla1"), losses(runs / "mla2")
    _close(one, two)
    assert one[4] < one[1], "loss should fall"
