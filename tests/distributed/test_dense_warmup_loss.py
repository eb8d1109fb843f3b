"""In the dense warm-up only the indexer learns: the logged loss is its KL, not the LM loss."""

import json

from tests.distributed.helpers import spawn, train_job


def test_dense_warmup_logs_the_indexer_kl_as_the_loss(job_args, tmp_path):
    spawn(1, train_job, job_args("warm", "train.steps=3", "train.dense_warmup_steps=2",
                                 "checkpoint.enable=false"))  # fmt: skip
    rows = [json.loads(x) for x in (tmp_path / "warm" / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    for step in (1, 2):  # dense warm-up steps
        assert train[step]["phase_sparse"] == 0.0
        assert train[step]["loss"] == train[step]["indexer_kl"]
        assert train[step]["loss"] != train[step]["lm_loss"]
    assert train[3]["phase_sparse"] == 1.0 and train[3]["loss"] == train[3]["lm_loss"]
