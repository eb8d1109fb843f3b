"""`wanka bench moe` on tiny shapes: rows for every expert count, JSON + Markdown, variants
agree with the loop, and the registry override is restored afterwards."""

import json
import os

from wanka.bench.moe import bench_moe_main, forced
from wanka.ops import registry


def test_bench_moe_writes_rows_and_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(registry.ENV_OVERRIDE, "sparse_attention=reference")
    out = tmp_path / "moe.json"
    shape = {"tokens": 64, "dim": 32, "hidden": 16, "seqs": 2, "repeats": 1}
    assert bench_moe_main(out, quick=True, experts=(8, 16), shape=shape, threads=(1, 2)) == 0
    doc = json.loads(out.read_text())
    assert [(r["threads"], r["experts"]) for r in doc["rows"]] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    for r in doc["rows"]:
        assert r["grouped_backend"] == "grouped_mm" and list(r["others_ms"]) == ["padded_bmm"]
        assert r["loop_ms"] > 0 and r["grouped_ms"] > 0 and r["others_ms"]["padded_bmm"] > 0
        assert set(r["max_rel_diff"]) == {"grouped", "padded_bmm"}
        assert max(r["max_rel_diff"].values()) < 1e-4
    table = (tmp_path / "moe.md").read_text()
    assert table.startswith(
        "| threads | experts | tokens | dim | hidden | loop ms | grouped ms | speed-up | padded_bmm ms |"
    )
    assert "| 2 | 16 | 64 | 32 | 16 |" in capsys.readouterr().out
    assert os.environ[registry.ENV_OVERRIDE] == "sparse_attention=reference"


def test_forced_keeps_other_ops_overrides(monkeypatch):
    monkeypatch.delenv(registry.ENV_OVERRIDE, raising=False)
    with forced("reference"):
        assert registry.select("grouped_swiglu", "cpu").name == "reference"
    assert registry.ENV_OVERRIDE not in os.environ
    monkeypatch.setenv(registry.ENV_OVERRIDE, "grouped_swiglu=padded_bmm,dense_attention=sdpa")
    with forced(None):
        assert os.environ[registry.ENV_OVERRIDE] == "dense_attention=sdpa"
