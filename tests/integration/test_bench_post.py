"""`wanka bench post --quick` end to end: every phase runs as a CLI job, the summary table and
post.json come out, and a rerun reuses the finished phases (slow: a dozen short jobs)."""

from __future__ import annotations

import json

import pytest

from .helpers import wanka

pytestmark = pytest.mark.slow


def test_bench_post_quick_runs_every_phase_and_reuses_them(tmp_path):
    out = tmp_path / "post"
    r = wanka("bench", "post", "--quick", "--out", str(out), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "post.json").read_text())
    assert set(result["runs"]) == {
        "mopd",
        "mopd_forward_kl",
        "single_code",
        "offpolicy_mixed",
        "sft_teacher_samples",
    }
    assert set(result["best_teacher"]) == {"code", "prose"}
    assert len(result["rl"]["seeds"]) == 2 and "compute to reach" in r.stdout
    again = wanka("bench", "post", "--quick", "--out", str(out), timeout=600)
    assert again.returncode == 0 and "done" in again.stdout
    # Another plan on the same directory is refused, not mixed in.
    other = wanka("bench", "post", "--quick", "--student-steps", "3", "--out", str(out))
    assert other.returncode == 2 and "other inputs" in other.stderr
