"""2-rank gloo runs compared with a single-process run on the same global batch."""

import json
import shutil

import pytest
import torch

from tests.distributed.helpers import losses, small_job, spawn, train_job


def _close(a: dict, b: dict, rtol=2e-4):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=rtol), f"step {k}: {a[k]} vs {b[k]}"


@pytest.fixture(scope="module")
def one_rank(dataset, tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the single-process reference (global batch 4 in one micro-batch, 4
    steps) that the data-parallel, expert-parallel and accumulation runs below are compared
    with: the same job for all three, so it runs once."""
    run = tmp_path_factory.mktemp("one_rank") / "one"
    spawn(1, train_job, small_job(dataset, run, "train.micro_batch_size=4",
                                  "checkpoint.enable=false"))  # fmt: skip
    return losses(run)


def test_fsdp_data_parallel_matches_single_process(job_args, tmp_path, one_rank):
    spawn(2, train_job, job_args("two", "train.micro_batch_size=2", "checkpoint.enable=false"))
    one, two = one_rank, losses(tmp_path / "two")
    assert len(one) == 4
    _close(one, two)
    assert one[4] < one[1], "loss should fall"


def test_expert_parallel_matches_non_parallel(job_args, tmp_path, one_rank):
    spawn(
        2,
        train_job,
        job_args("ep", "train.micro_batch_size=2", "parallel.ep=2", "checkpoint.enable=false"),
    )
    _close(one_rank, losses(tmp_path / "ep"))


def test_grad_accumulation_matches_bigger_batch(job_args, tmp_path, one_rank):
    spawn(1, train_job, job_args("acc", "train.micro_batch_size=2", "train.grad_accum=2",
                                 "checkpoint.enable=false"))  # fmt: skip
    _close(one_rank, losses(tmp_path / "acc"))


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


def test_four_ranks_dp4_ep2_matches_single_process(job_args, tmp_path):
    """dp 4 x ep 2: experts split over ep and FSDP-sharded over dp_mod_ep = 2 (2-D sharding)."""
    spawn(
        1,
        train_job,
        job_args("one", "train.micro_batch_size=4", "train.steps=3", "checkpoint.enable=false"),
    )
    spawn(4, train_job, job_args("four", "train.micro_batch_size=1", "train.steps=3", "parallel.ep=2",
                                 "checkpoint.enable=false"))  # fmt: skip
    _close(losses(tmp_path / "one"), losses(tmp_path / "four"))


def test_mla_under_fsdp_and_ep_matches_single_process(job_args, tmp_path):
    mla = ('model.attention="mla"', "checkpoint.enable=false")
    spawn(1, train_job, job_args("one", "train.micro_batch_size=4", *mla))
    spawn(2, train_job, job_args("two", "train.micro_batch_size=2", "parallel.ep=2", *mla))
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    _close(one, two)
    assert one[4] < one[1], "loss should fall"
