"""Asking for fewer steps than the run directory already holds is an error, not a silent
exit 0 that rewrote summary.json with a null loss and eval rows for the wrong step."""

import pytest

from tests.distributed.helpers import spawn, train_job


def test_fewer_steps_than_the_checkpoint_is_refused(job_args, tmp_path):
    spawn(1, train_job, job_args("run", "train.steps=3", "resilience.snapshot_every=0"))
    summary = (tmp_path / "run" / "summary.json").read_text()
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(Exception, match="already at step 3 but train.steps=2"):
        spawn(1, train_job, job_args("run", "train.steps=2", "resilience.snapshot_every=0"))
    assert (tmp_path / "run" / "summary.json").read_text() == summary
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
