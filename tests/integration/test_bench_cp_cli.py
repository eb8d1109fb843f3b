"""`wanka bench cp` end to end, as a user runs it: 4 spawned ranks on a user's length file at
a short sequence (about a minute on 2 cores), then `--simulate` with the cost model it fitted."""

import json

import pytest

from .helpers import wanka

LAYOUTS = ("contiguous", "head_tail", "dynamic")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_cp_quick_then_simulate(tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# my corpus\n" + "\n".join(str(n) for n in (40, 300, 900, 2500, 5000)))
    out = tmp_path / "cp.json"
    r = wanka("bench", "cp", "--quick", "--lengths", str(lengths), "--seq-len", "2048",
              "--steps", "1", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["lengths"]["source"] == str(lengths) and doc["lengths"]["count"] == 5
    assert doc["setup"]["nproc"] == 4 and doc["setup"]["model"]["index_topk"] > 0
    (run,) = doc["runs"]
    assert list(run["layouts"]) == list(LAYOUTS)
    for s in run["layouts"].values():
        assert s["tokens_per_s"] > 0 and s["compute_bound_tokens_per_s"] > 0
        assert s["mean_imbalance"] >= 1.0 and len(s["compute_s"]) == 1
        assert all(t > 0 for t in s["compute_s"][0]) and sum(s["tokens_per_rank"][0]) == 2048
    assert set(run["ratios"]["compute_bound_tokens_per_s"]) == {"vs_contiguous", "vs_head_tail"}
    # 2 calibration steps x (contiguous, head_tail) + 1 timed step x 3 layouts, on 4 ranks
    assert doc["fit"]["samples"] == 4 * (2 * 2 + 3) and doc["cost_model"]["topk"] == 256
    assert out.with_suffix(".png").read_bytes()[:8] == PNG
    assert "| 2048 | dynamic |" in out.with_suffix(".md").read_text() and "| 2048 |" in r.stdout

    sim = tmp_path / "sim.json"
    r = wanka("bench", "cp", "--simulate", "--ranks", "16,64", "--seq-len", "4096", "--steps",
              "2", "--lengths", str(lengths), "--cost", str(out), "--out", str(sim))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    sdoc = json.loads(sim.read_text())
    assert sdoc["cost_model"]["linear"] == doc["cost_model"]["linear"]
    assert {(x["ranks"], x["layout"]) for x in sdoc["rows"]} == {
        (n, x) for n in (16, 64) for x in LAYOUTS
    }
    assert sim.with_suffix(".png").read_bytes()[:8] == PNG


def test_bench_cp_replay_on_a_length_file(tmp_path):
    """--replay: no spawned ranks; the same result file, its mode and notes say how it was
    measured, and every (rank, step) record ran `--repeats` times."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (40, 300, 900, 2500)))
    out = tmp_path / "replay.json"
    r = wanka("bench", "cp", "--replay", "--repeats", "2", "--dp", "2", "--cp", "2",
              "--lengths", str(lengths), "--seq-len", "1024", "--steps", "1", "--index-topk", "64",
              "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "replay" and doc["setup"]["replay_repeats"] == 2
    assert doc["notes"][0].startswith("replayed:")
    (run,) = doc["runs"]
    assert list(run["layouts"]) == list(LAYOUTS)
    for s in run["layouts"].values():
        assert sum(s["tokens_per_rank"][0]) == 2048 and all(t > 0 for t in s["compute_s"][0])
        # Replay's step is its busiest rank: tokens/s is the compute-bound figure.
        assert s["tokens_per_s"] == pytest.approx(s["compute_bound_tokens_per_s"])
    assert doc["fit"]["samples"] == 4 * (2 * 2 + 3)
    assert doc["setup"]["model"]["index_topk"] == 64 and doc["cost_model"]["topk"] == 64
    assert "targets at 1024 tokens" in r.stdout
