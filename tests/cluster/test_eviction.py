"""A node that fails every time it starts is evicted after the policy's threshold and the job
finishes on the remaining node, resharding the DCP checkpoint to the smaller world: with the
supervisor reading the shared run directory, and with it learning of the ranks only through
the control store (each node's memory its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# Files mode evicts through the same supervisor code: `make test-slow` (CI time budget).
@pytest.mark.parametrize("control", [pytest.param("files", marks=pytest.mark.slow), "store"])
def test_failing_node_is_evicted_and_job_finishes(wanka_cluster, tmp_path, control):
    sets = [f'resilience.control="{control}"', "data.seq_len=64", "train.micro_batch_size=2", "train.steps=8", "train.warmup_steps=2",
            "model.index_topk=16", "train.eval_every=1000", "data.val_batches=1", "parallel.ep=1",
            "checkpoint.every=2", "run.tensorboard=false", f'run.dir="{tmp_path / "run"}"',
            f'resilience.ledger="{tmp_path / "faults.sqlite"}"', "resilience.evict_same_cause=2"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "wanka.cli", "train", "configs/demo.toml", "--cluster", "--nproc", "1",
         "--cluster-state", wanka_cluster.state_dir, "--chaos", "fail_start@node=1,times=5,counted=1",
         *sum((["--set", s] for s in sets), [])],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "evicting node n1" in r.stderr and "continuing on n0" in r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 8
    nodes = subprocess.run([sys.executable, "-m", "wanka.cli", "nodes", "--ledger",
                            str(tmp_path / "faults.sqlite")], capture_output=True, text=True)  # fmt: skip
    assert nodes.returncode == 0 and "evicted" in nodes.stdout and "n1" in nodes.stdout
    causes = [json.loads(x).get("cause") for x in
              (tmp_path / "run" / "resilience" / "timeline.jsonl").read_text().splitlines()
              if '"fault"' in x]  # fmt: skip
    assert causes.count("startup_failure") == 2  # evicted at the policy's threshold, not later
