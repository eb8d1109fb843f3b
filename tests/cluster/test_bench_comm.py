"""`wanka bench comm --quick` end to end on a real cluster-in-a-box (2 nodes x 2 ranks, 1 Gbit/s):
bytes per step come from the interface counters and move the way the option says. About 2
minutes on 2 cores."""

from __future__ import annotations

import json

import pytest

from tests.integration.helpers import wanka
from wanka.cluster.fixtures import skip_unless_available


@pytest.mark.slow
def test_bench_comm_quick_flat_vs_bf16_reduce(tmp_path):
    skip_unless_available()
    out = tmp_path / "comm.json"
    r = wanka("bench", "comm", "--quick", "--cases", "flat_fp32,flat_bf16", "--gbit", "1",
              "--out", str(out), timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [c["name"] for c in doc["cases"]] == ["flat_fp32", "flat_bf16"]
    (link,) = doc["links"]
    flat, bf16 = link["cases"]["flat_fp32"], link["cases"]["flat_bf16"]
    for s in (flat, bf16):
        assert s["error"] is None and s["bytes_per_step"] > 1e6  # the model's bytes cross
        assert all(v > 0 for v in s["sent_per_step_by_node"].values())  # both directions
        assert s["step_time_s"] > 0 and s["tokens_per_s"] > 0
        # The within-run counter window agrees with the two-run difference.
        assert s["window_bytes_per_step"] == pytest.approx(s["bytes_per_step"], rel=0.05)
    # bf16 halves the gradient reduce-scatter; the fp32 parameter all-gathers stay.
    assert 0.6 < bf16["ratios"]["bytes_per_step"] < 0.95
    assert flat["ratios"]["bytes_per_step"] == 1.0
    assert "| flat_bf16 |" in out.with_suffix(".md").read_text() and "| flat_bf16 |" in r.stdout
