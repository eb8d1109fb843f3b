"""`wanka chaos drill --cluster`: remote faults on the cluster-in-a-box are each detected and named
on the node they struck, and the job ends bitwise where a fault-free run does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # three jobs across two nodes, ~4 min
def test_cluster_drill_names_every_fault_on_its_node(wanka_cluster, tmp_path):
    # Snapshots: the default /dev/shm/wanka, each node's own memory.
    sets = ["data.seq_len=64", "train.micro_batch_size=2", "train.steps=24", "train.warmup_steps=2",
            "model.index_topk=16", "train.eval_every=1000", "data.val_batches=1", "parallel.ep=1",
            "run.tensorboard=false", 'resilience.control="store"', 'resilience.preflight="off"',
            f'resilience.ledger="{tmp_path / "faults.sqlite"}"', "resilience.hang_floor_s=3.0"]  # fmt: skip
    schedule = "kill@step=5,rank=1;node_kill@step=11,node=1;link_cut@step=17,node=1,for=6"
    argv = [sys.executable, "-m", "wanka.cli", "chaos", "drill", "configs/demo.toml", "--cluster",
            "--cluster-state", wanka_cluster.state_dir, "--nproc", "1", "--no-baseline",
            "--out", str(tmp_path / "drill"), "--schedule", schedule,
            *sum((["--set", s] for s in sets), [])]  # fmt: skip
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads((tmp_path / "drill" / "drill.json").read_text())
    assert result["cluster"] is True
    run = result["runs"]["wanka"]
    assert run["state_equal"], run
    rows = run["injected"]
    assert [f["kind"] for f in rows] == ["kill", "node_kill", "link_cut"]
    assert [f["detected_as"] for f in rows] == ["process_crash", "node_lost", "node_lost"]
    assert all(f["node"] == f["named_node"] == "n1" for f in rows), rows
    # The node kill and the cut link (a crash is seen at once, not judged by a limit).
    assert run["within_limit"] == "2/2", rows  # each named within its learned hang limit
    assert " on" in r.stdout and "node_lost" in r.stdout  # the table's node columns
