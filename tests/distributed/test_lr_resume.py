"""A run extended on resume (more train.steps) under a fixed lr_horizon continues bitwise like a
run that had the longer step count from the start."""

import json
from pathlib import Path

from tests.distributed.helpers import losses, spawn, spawn_jobs, train_job


def _rates(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}


def test_extending_steps_under_a_fixed_horizon_resumes_exactly(job_args, tmp_path):
    # WSD over 12 steps: 2 of warm-up, stable, the last 3 decaying (steps 10..12).
    schedule = ("train.lr_schedule=wsd", "train.lr_horizon=12", "train.decay_fraction=0.25",
                "train.warmup_steps=2", "checkpoint.every=6", "train.micro_batch_size=2")  # fmt: skip
    spawn_jobs(1, job_args("extended", *schedule, "train.steps=6"),
               job_args("whole", *schedule, "train.steps=12"))  # fmt: skip
    spawn(1, train_job, job_args("extended", *schedule, "train.steps=12"))  # resumes from 6
    extended, whole = tmp_path / "extended", tmp_path / "whole"
    assert json.loads((extended / "summary.json").read_text())["resumed_from_step"] == 6
    after = range(7, 13)
    a, b = losses(extended), losses(whole)
    assert [a[s] for s in after] == [b[s] for s in after]  # exact equality, not approx
    assert _rates(extended) == _rates(whole)  # the same LR curve throughout
    assert _rates(whole)[12] < _rates(whole)[9]  # the decay ran


def _markers(run_dir, kind):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def test_a_resume_that_changes_the_schedule_says_so(job_args, tmp_path):
    """Raising train.steps under a cosine tied to it moves the LR: one marker row says how."""
    base = ("checkpoint.every=3", "train.micro_batch_size=2")
    spawn(1, train_job, job_args("run", *base, "train.steps=3"))
    spawn(1, train_job, job_args("run", *base, "train.steps=6"))
    (row,) = _markers(tmp_path / "run", "lr_schedule_change")
    assert row["step"] == 3 and "horizon 3 -> 6 (train.steps)" in row["message"]
    assert "(a jump)" in row["message"] and "train.lr_horizon=3" in row["message"]
