"""The `wanka bench ops` harness on tiny shapes: it must measure the selected backends."""

import dataclasses

import pytest
import torch

from wanka.bench.longctx import crossover, model_step_times
from wanka.bench.ops import estimate_bytes, run_case
from wanka.config.schema import ModelConfig


@pytest.mark.parametrize(
    "case",
    [
        dict(op="sparse_attention", backend="cpu", L=96, k=16, H=2, D=8, pattern="realistic"),
        dict(op="sparse_attention", backend="cpu", L=96, k=16, H=2, D=8, pattern="random"),
        dict(op="dense_attention", backend="cpu", L=96, H=2, D=8),
        dict(op="lightning_indexer", backend="cpu", L=96, k=16, Hi=2, Di=8),
    ],
)
def test_run_case_times_and_checks_against_reference(case, monkeypatch):
    monkeypatch.setenv("WANKA_OPS_BACKEND", "")  # run_case sets it; restored after the test
    r = run_case(case, repeats=1)
    assert r["fwd_s"] > 0 and r["fwd_bwd_s"] > 0 and r["fwd_bwd_gflops"] > 0
    assert r["max_abs_err"] < 1e-4


def test_reference_memory_estimate_grows_with_length():
    a = dict(op="sparse_attention", backend="reference", L=4096, k=1024, H=16, D=64)
    assert estimate_bytes({**a, "L": 8192}) == 2 * estimate_bytes(a)
    assert estimate_bytes({**a, "backend": "cpu"}) == 0


def test_long_context_helpers_measure_the_indexer():
    c = crossover(16, [32, 64], H=2, D=8, repeats=1)
    assert [r["L"] for r in c["rows"]] == [32, 64] and c["backends"]["sparse_attention"] == "cpu"
    cfg = dataclasses.replace(ModelConfig(), n_layers=4, index_topk=16)
    rows = model_step_times(cfg, [64], [1, 4], repeats=1)
    assert [r["indexer_layers"] for r in rows] == [4, 1]
    assert all(0 < r["indexer_s"] < r["step_s"] for r in rows)


def test_peak_window_sees_the_op_not_what_came_before():
    from wanka.bench.ops import peak_rss_window

    before = torch.ones(48 * 2**20)  # 192 MiB touched before the window: not the op's
    del before
    window = peak_rss_window()
    assert window() < 64, "allocations made before the window leaked into it"
    x = torch.ones(32 * 2**20)  # 128 MiB inside the window
    grown = window()
    del x
    assert grown >= 100


def test_nonfinite_output_where_the_reference_is_finite_is_an_error(monkeypatch):
    from wanka.ops import registry

    table = registry._REGISTRY["dense_attention"]
    real = table["cpu"]

    def broken(q, k, v, doc_ids, scale):
        out = real.fn(q, k, v, doc_ids, scale)
        return torch.where(torch.arange(out.shape[1])[None, :, None, None] == 3, float("nan"), out)

    monkeypatch.setitem(table, "cpu", dataclasses.replace(real, fn=broken))
    monkeypatch.setenv("WANKA_OPS_BACKEND", "")
    r = run_case(dict(op="dense_attention", backend="cpu", L=32, H=2, D=8), repeats=1)
    assert r["max_abs_err"] == float("inf")
